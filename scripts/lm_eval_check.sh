#!/usr/bin/env bash
# lm-eval's `local-completions` against `mtp serve` (the trained family) on two tiny local
# tasks in scripts/lm_eval_tasks (no downloads): a multiple-choice task, scored through the
# server's echo logprobs, and a generate_until task. lm-eval tokenizes through the server
# (`/tokenizer_info`, `/tokenize`), so no tokenizer is loaded on its side.
#
#   python3 -m venv /tmp/venv-lmeval && /tmp/venv-lmeval/bin/pip install "lm-eval[api]==0.4.13"
#   cargo build --release
#   LM_EVAL_PYTHON=/tmp/venv-lmeval/bin/python scripts/lm_eval_check.sh
#
# Run twice (batch sizes 1 and 8): the scores must be the same, as each request's logprobs
# are those of the request alone.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${LM_EVAL_PYTHON:-python3}"
port="${PORT:-8391}"
out="$(mktemp -d)"
"$root/target/release/mtp" serve --port "$port" --max-batch 8 > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    sleep 0.2
done
curl -sf "http://127.0.0.1:$port/health" > /dev/null || { cat "$out/serve.log"; exit 1; }
cd "$root/scripts/lm_eval_tasks"
for batch in 1 8; do
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$python" -m lm_eval --model local-completions \
        --model_args "model=mtp-trained,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,max_retries=1" \
        --tasks mtp_rust_mc,mtp_rust_gen --include_path . --batch_size "$batch" \
        --output_path "$out/batch$batch" --log_samples > "$out/batch$batch.txt" 2>&1 \
        || { tail -40 "$out/batch$batch.txt"; exit 1; }
    grep -E "^\|" "$out/batch$batch.txt"
done
# The per-sample results (each choice's loglikelihood, each generation) equal across batch sizes.
"$python" - "$out" <<'PY'
import glob, json, sys
def samples(batch):
    got = {}
    for path in sorted(glob.glob(f"{sys.argv[1]}/batch{batch}/**/samples_*.jsonl", recursive=True)):
        task = path.rsplit("samples_", 1)[1].rsplit("_", 1)[0]
        with open(path) as f:
            got[task] = [(s["doc_id"], s["resps"]) for s in map(json.loads, f)]
    return got
one, eight = samples(1), samples(8)
assert one and set(one) == set(eight), (sorted(one), sorted(eight))
for task in one:
    assert sorted(one[task]) == sorted(eight[task]), f"{task}: batch 1 and 8 differ"
    print(f"{task}: {len(one[task])} samples, the same at batch sizes 1 and 8")
PY
