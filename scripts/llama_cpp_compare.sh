#!/usr/bin/env bash
# Side-by-side CPU comparison of this engine (plain decoding) with llama.cpp, on the
# Qwen3-0.6B shape with random weights (issue 37). Run from anywhere:
#
#     scripts/llama_cpp_compare.sh [WORKDIR]
#
# WORKDIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/mtp-llama-cpp) gets, each step skipped
# when its output is already there (a second run only measures):
#   venv/          Python venv with pinned cmake, ninja, numpy, ... (and mlx + mlx-lm for
#                  the 4-bit checkpoint; if those cannot install, row (d) is left out)
#   src/           the pinned llama-cpp-python sdist, unpacked; its vendor/llama.cpp is
#                  what gets built and whose gguf-py the converter imports
#   build/bin/     llama-bench, llama-batched-bench, llama-quantize, llama-completion
#                  (Release, -DGGML_NATIVE=ON, CPU only)
#   qwen3-bf16/    `mtp synth --like qwen3 --dtype bf16 --seed 1`
#   qwen3-bf16.gguf  scripts/gguf_from_hf.py (no torch), checked: llama.cpp's greedy text
#                  equals `mtp generate --drafter none`'s (gguf-check.txt)
#   qwen3-q4_0.gguf  llama-quantize Q4_0
#   qwen3-mlx4/    mlx_lm convert -q --q-bits 4 --q-group-size 64
#   runs/DATE/     raw JSON of every measurement and table.md
#
# Then measures, alternating the engines (which goes first flips every repeat), REPEATS
# times each, THREADS threads: (a) decode B=1 bf16, (b) decode B=8 aggregate bf16,
# (c) prefill of one PP_TOKENS-token prompt bf16, (d) decode B=1 4-bit (llama.cpp Q4_0,
# mtp MLX affine 4-bit g64), and prints one markdown table of medians and min-max.
#
# Environment: THREADS (2), REPEATS (3), TG_TOKENS (128), PP_TOKENS (512), BATCH (8),
# MTP_ACTIVATIONS (auto: mtp's matmul activations, --activations; auto is bf16 on CPUs
# with AVX512-BF16, rounding them as llama.cpp's bf16 matmul does, f32 on others),
# MTP_KV_DTYPE (auto: --kv-dtype; auto is bf16 for these 16-bit checkpoints, as llama.cpp
# keeps f16 K/V), MTP_PREFILL_CHUNK (64, the CPU default: tokens per prefill forward;
# llama-bench's pp runs the prompt as one batch),
# MTP_BIN_DIR (default: target/release of this repository, built if mtp or mtp-bench is
# missing), PYTHON (python3, 3.10 or newer, to create the venv).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORKDIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/mtp-llama-cpp}
mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
TG_TOKENS=${TG_TOKENS:-128}
PP_TOKENS=${PP_TOKENS:-512}
BATCH=${BATCH:-8}
PYTHON=${PYTHON:-python3}
MTP_ACTIVATIONS=${MTP_ACTIVATIONS:-auto}
MTP_KV_DTYPE=${MTP_KV_DTYPE:-auto}
MTP_PREFILL_CHUNK=${MTP_PREFILL_CHUNK:-64}
LLAMA_CPP_PYTHON=0.3.36

VENV=$WORKDIR/venv
PY=$VENV/bin/python
SRC=$WORKDIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON
LLAMA=$SRC/vendor/llama.cpp
BUILD=$WORKDIR/build
BIN=$BUILD/bin
BF16=$WORKDIR/qwen3-bf16
GGUF=$WORKDIR/qwen3-bf16.gguf
Q4=$WORKDIR/qwen3-q4_0.gguf
MLX4=$WORKDIR/qwen3-mlx4

log() { printf '== %s\n' "$*" >&2; }
T0=$SECONDS

# Build tools, gguf-py's needs (numpy, pyyaml, tqdm) and the sdist's build backend, which
# `pip download` runs (without build isolation, which would build cmake from source) to
# read the package's metadata.
CORE_REQS="cmake==4.4.5
ninja==1.13.2
numpy==2.4.6
pyyaml==6.0.4
tqdm==4.70.1
scikit-build-core==1.1.2
packaging==26.4
pathspec==1.1.1"
# mlx-lm 0.32.2 with mlx 0.32.4 (as scripts/make_mlx_fixtures.py) and every package they
# pull in, pinned (installed with --no-deps, then `pip check`).
MLX_REQS="mlx==0.32.4
mlx-cpu==0.32.4
mlx-lm==0.32.2
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
click==8.5.1
filelock==4.3.1
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
Jinja2==3.1.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
protobuf==7.36.2
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
regex==2026.11.19
rich==15.0.0
safetensors==0.8.0
sentencepiece==0.2.3
shellingham==1.5.4
tokenizers==0.23.3
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0"

# 1. The venv.
if [ ! -x "$PY" ]; then
    log "venv: $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.core-reqs" 2>/dev/null)" != "$CORE_REQS" ]; then
    log "venv: installing ${CORE_REQS//$'\n'/ }"
    "$PY" -m pip install -q pip==26.3
    printf '%s\n' "$CORE_REQS" > "$WORKDIR/requirements-core.txt"
    "$PY" -m pip install -q --no-deps -r "$WORKDIR/requirements-core.txt"
    printf '%s' "$CORE_REQS" > "$VENV/.core-reqs"
fi
MLX_OK=1
if [ "$(cat "$VENV/.mlx-reqs" 2>/dev/null)" != "$MLX_REQS" ]; then
    log "venv: installing mlx 0.32.4 and mlx-lm 0.32.2"
    printf '%s\n' "$MLX_REQS" > "$WORKDIR/requirements-mlx.txt"
    if "$PY" -m pip install -q --no-deps -r "$WORKDIR/requirements-mlx.txt" && "$PY" -m pip check >&2; then
        printf '%s' "$MLX_REQS" > "$VENV/.mlx-reqs"
    else
        MLX_OK=0
        log "WARNING: mlx / mlx-lm did not install: no MLX 4-bit checkpoint, row (d) has no mtp side"
    fi
fi

# 2. llama.cpp, vendored in the pinned llama-cpp-python sdist.
if [ ! -f "$LLAMA/CMakeLists.txt" ]; then
    mkdir -p "$WORKDIR/src"
    TARBALL=$WORKDIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz
    if [ ! -f "$TARBALL" ]; then
        log "llama.cpp: pip download llama-cpp-python==$LLAMA_CPP_PYTHON (sdist)"
        "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
            "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$WORKDIR/src"
    fi
    log "llama.cpp: unpacking $TARBALL"
    rm -rf "$SRC"
    tar -xzf "$TARBALL" -C "$WORKDIR/src"
fi
LLAMA_TOOLS=(llama-bench llama-batched-bench llama-quantize llama-completion)
missing_tool=0
for t in "${LLAMA_TOOLS[@]}"; do [ -x "$BIN/$t" ] || missing_tool=1; done
if [ "$missing_tool" = 1 ]; then
    log "llama.cpp: building ${LLAMA_TOOLS[*]} in $BUILD"
    "$VENV/bin/cmake" -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_RPC=OFF \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF >&2
    "$VENV/bin/ninja" -C "$BUILD" "${LLAMA_TOOLS[@]}" >&2
fi

# 3. Our binaries.
MTP_BIN_DIR=${MTP_BIN_DIR:-$REPO/target/release}
if [ ! -x "$MTP_BIN_DIR/mtp" ] || [ ! -x "$MTP_BIN_DIR/mtp-bench" ]; then
    [ "$MTP_BIN_DIR" = "$REPO/target/release" ] || { echo "error: $MTP_BIN_DIR lacks mtp or mtp-bench" >&2; exit 1; }
    log "mtp: cargo build --release --bin mtp --bin mtp-bench"
    (cd "$REPO" && cargo build --release --bin mtp --bin mtp-bench)
fi
MTP=$MTP_BIN_DIR/mtp
MTP_BENCH=$MTP_BIN_DIR/mtp-bench

# 4. The checkpoints.
if [ ! -f "$BF16/model.safetensors" ]; then
    log "checkpoint: mtp synth --like qwen3 --dtype bf16 --seed 1"
    rm -rf "$BF16.partial"
    "$MTP" synth --like qwen3 --dtype bf16 --seed 1 --out "$BF16.partial" >&2
    rm -rf "$BF16" "$GGUF" "$Q4" "$MLX4" "$WORKDIR/gguf-check.txt"  # all made from it
    mv "$BF16.partial" "$BF16"
fi
if [ ! -f "$GGUF" ]; then
    log "gguf: scripts/gguf_from_hf.py $BF16 -> $GGUF"
    rm -f "$Q4" "$WORKDIR/gguf-check.txt"  # made from it
    PYTHONPATH=$LLAMA/gguf-py "$PY" "$REPO/scripts/gguf_from_hf.py" "$BF16" "$GGUF"
fi
if [ ! -f "$WORKDIR/gguf-check.txt" ]; then
    log "gguf: checking $GGUF loads and generates"
    # The GGUF must load and generate: greedy text from llama.cpp beside ours (equal unless a
    # near-tie falls differently: llama.cpp's bf16 arithmetic is not our f32 one). The prompt
    # must not end in a newline: llama.cpp's -f drops one.
    PROMPT=$'fn main() {\n    let hidden = tokens;'
    printf '%s' "$PROMPT" > "$WORKDIR/check-prompt.txt"
    "$BIN/llama-completion" -m "$GGUF" -f "$WORKDIR/check-prompt.txt" -n 16 --temp 0 --ignore-eos \
        -no-cnv -t "$THREADS" -c 512 --no-display-prompt --no-warmup > "$WORKDIR/check-llama.txt" 2> "$WORKDIR/check-llama.log" \
        || { tail -20 "$WORKDIR/check-llama.log" >&2; exit 1; }
    "$PY" -c 'import json,sys; print(json.dumps({"id": "check", "prompt": sys.argv[1]}))' "$PROMPT" > "$WORKDIR/check-prompt.jsonl"
    RAYON_NUM_THREADS=$THREADS "$MTP" generate --target "$BF16" --prompts "$WORKDIR/check-prompt.jsonl" \
        --drafter none --max-tokens 16 --ignore-eos > "$WORKDIR/check-mtp.jsonl" 2> "$WORKDIR/check-mtp.log" \
        || { tail -20 "$WORKDIR/check-mtp.log" >&2; exit 1; }
    "$PY" - "$WORKDIR" > "$WORKDIR/gguf-check.txt.partial" <<'EOF'
import json, sys
w = sys.argv[1]
ours = json.loads(open(f"{w}/check-mtp.jsonl").readline())["text"]
# llama-completion ends its output with a newline of its own.
theirs = open(f"{w}/check-llama.txt", encoding="utf-8").read().rstrip("\n")
same = 0
while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
    same += 1
verdict = "identical" if ours == theirs else f"first {same} characters equal"
print(f"GGUF check: 16 greedy tokens from llama.cpp (llama-completion, bf16 GGUF) and mtp generate --drafter none: {verdict}")
print(f"  llama.cpp: {theirs!r}")
print(f"  mtp:       {ours!r}")
EOF
    mv "$WORKDIR/gguf-check.txt.partial" "$WORKDIR/gguf-check.txt"
    cat "$WORKDIR/gguf-check.txt" >&2
fi
if [ ! -f "$Q4" ]; then
    log "gguf: llama-quantize Q4_0 -> $Q4"
    "$BIN/llama-quantize" "$GGUF" "$Q4.partial" Q4_0 "$THREADS" > "$WORKDIR/quantize.log" 2>&1 \
        || { tail -20 "$WORKDIR/quantize.log" >&2; exit 1; }
    mv "$Q4.partial" "$Q4"
fi
if [ ! -f "$MLX4/config.json" ] && [ "$MLX_OK" = 1 ]; then
    log "mlx: mlx_lm convert -q --q-bits 4 --q-group-size 64 -> $MLX4"
    rm -rf "$MLX4.partial"
    if "$PY" -m mlx_lm convert --hf-path "$BF16" --mlx-path "$MLX4.partial" -q --q-bits 4 --q-group-size 64 >&2; then
        mv "$MLX4.partial" "$MLX4"
    else
        log "WARNING: mlx_lm convert failed: row (d) has no mtp side"
    fi
fi
SETUP_SECONDS=$((SECONDS - T0))

# 5. Prompts: token ids, so both engines see the same counts (llama.cpp's tools draw random
# ids themselves; content does not change speed). Decode prompts are 8 tokens long, as
# llama-batched-bench's -npp 8; llama-bench's tg starts from an empty context.
PROMPTS=$WORKDIR/prompts
mkdir -p "$PROMPTS"
"$PY" - "$PROMPTS" "$BATCH" "$PP_TOKENS" <<'EOF'
import json, sys
out, batch, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = lambda seed, n: [3 + (seed * 97 + j * 31 + j // 7) % 500 for j in range(n)]
with open(f"{out}/decode-b1.jsonl", "w") as f:
    f.write(json.dumps({"id": "d0", "prompt_ids": ids(0, 8)}) + "\n")
with open(f"{out}/decode-b{batch}.jsonl", "w") as f:
    for i in range(batch):
        f.write(json.dumps({"id": f"d{i}", "prompt_ids": ids(i, 8)}) + "\n")
with open(f"{out}/prefill-{pp}.jsonl", "w") as f:
    f.write(json.dumps({"id": "p0", "prompt_ids": ids(1, pp)}) + "\n")
EOF

# 6. Measurements.
RUN=$WORKDIR/runs/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$RUN"
RESULTS=$RUN/results.tsv
: > "$RESULTS"
: > "$RUN/commands.txt"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# record ROW ENGINE COMMAND...: runs it (stdout to $OUT_FILE), notes the command once.
record() {
    local row=$1 engine=$2
    shift 2
    local line
    line=$(printf '%q ' "$@")
    line=${line//"$RUN/"/RUN/}
    grep -qxF "($row) $engine: $line" "$RUN/commands.txt" || echo "($row) $engine: $line" >> "$RUN/commands.txt"
    "$@" > "$OUT_FILE" 2> "$OUT_FILE.log" || { tail -20 "$OUT_FILE.log" >&2; exit 1; }
}
value() {  # value KIND FILE [ARGS]: the row's tokens/s from a tool's JSON
    "$PY" - "$@" <<'EOF'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
if kind == "llama-bench":
    print(json.load(open(path))[0]["avg_ts"])
elif kind == "batched-bench":
    lines = [l for l in open(path) if l.startswith("{")]
    print(json.loads(lines[-1])["speed_tg"])
else:
    r = json.load(open(path))["rows"][0]
    if kind == "mtp-decode":
        # Each request's first token comes from its prefill's logits: decode made the rest.
        n = len(r["requests"])
        print((r["tokens"] - n) / (r["seconds"] - r["prefill_seconds"]))
    else:  # mtp-prefill
        print(int(sys.argv[3]) / r["prefill_seconds"])
EOF
}
measure() {  # measure ROW ENGINE REP
    local row=$1 engine=$2 rep=$3 v
    OUT_FILE=$RUN/$row-$engine-$rep.json
    local json=$RUN/mtp-bench.json  # mtp-bench's --json, moved to OUT_FILE (its stdout is the .md)
    [ "$engine" = mtp ] && OUT_FILE=$RUN/$row-$engine-$rep.md
    local mtpb=(env RAYON_NUM_THREADS="$THREADS" "$MTP_BENCH" --drafters '' --temperatures 0 --repeats 1
                --activations "$MTP_ACTIVATIONS" --kv-dtype "$MTP_KV_DTYPE" --prefill-chunk "$MTP_PREFILL_CHUNK")
    case "$row-$engine" in
        a-llama.cpp) record a llama.cpp "$BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p 0 -n "$TG_TOKENS" -r 1 -o json
                     v=$(value llama-bench "$OUT_FILE") ;;
        a-mtp) record a mtp "${mtpb[@]}" --target "$BF16" --batch 1 --prompts "$PROMPTS/decode-b1.jsonl" \
                   --max-tokens "$TG_TOKENS" --json "$json"
               OUT_FILE=${OUT_FILE%.md}.json; mv "$json" "$OUT_FILE"; v=$(value mtp-decode "$OUT_FILE") ;;
        b-llama.cpp) record b llama.cpp "$BIN/llama-batched-bench" -m "$GGUF" -t "$THREADS" -c 4096 \
                         -npp 8 -ntg "$TG_TOKENS" -npl "$BATCH" --output-format jsonl
                     v=$(value batched-bench "$OUT_FILE") ;;
        b-mtp) record b mtp "${mtpb[@]}" --target "$BF16" --batch "$BATCH" --prompts "$PROMPTS/decode-b$BATCH.jsonl" \
                   --max-tokens "$TG_TOKENS" --json "$json"
               OUT_FILE=${OUT_FILE%.md}.json; mv "$json" "$OUT_FILE"; v=$(value mtp-decode "$OUT_FILE") ;;
        c-llama.cpp) record c llama.cpp "$BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p "$PP_TOKENS" -n 0 -r 1 -o json
                     v=$(value llama-bench "$OUT_FILE") ;;
        c-mtp) record c mtp "${mtpb[@]}" --target "$BF16" --batch 1 --prompts "$PROMPTS/prefill-$PP_TOKENS.jsonl" \
                   --max-tokens 1 --json "$json"
               OUT_FILE=${OUT_FILE%.md}.json; mv "$json" "$OUT_FILE"; v=$(value mtp-prefill "$OUT_FILE" "$PP_TOKENS") ;;
        d-llama.cpp) record d llama.cpp "$BIN/llama-bench" -m "$Q4" -t "$THREADS" -p 0 -n "$TG_TOKENS" -r 1 -o json
                     v=$(value llama-bench "$OUT_FILE") ;;
        d-mtp) record d mtp "${mtpb[@]}" --target "$MLX4" --batch 1 --prompts "$PROMPTS/decode-b1.jsonl" \
                   --max-tokens "$TG_TOKENS" --json "$json"
               OUT_FILE=${OUT_FILE%.md}.json; mv "$json" "$OUT_FILE"; v=$(value mtp-decode "$OUT_FILE") ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$row" "$engine" "$rep" "$v" >> "$RESULTS"
    log "($row) $engine, repeat $rep: $(printf '%.2f' "$v") tokens/s"
}

T1=$SECONDS
for rep in $(seq 1 "$REPEATS"); do
    for row in a b c d; do
        engines=(llama.cpp mtp)
        [ $((rep % 2)) = 0 ] && engines=(mtp llama.cpp)
        for engine in "${engines[@]}"; do
            if [ "$row-$engine" = d-mtp ] && [ ! -f "$MLX4/config.json" ]; then continue; fi
            measure "$row" "$engine" "$rep"
        done
    done
done
MEASURE_SECONDS=$((SECONDS - T1))
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

# 7. The table.
CPU_MODEL=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
ISA=$(for f in avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_int8; do
    grep -qw "$f" /proc/cpuinfo && printf '%s ' "$f"; done || true)
ISA=${ISA% }
{
    echo "## mtp vs llama.cpp on the CPU ($(date -u +%Y-%m-%d))"
    echo
    echo "CPU: $CPU_MODEL ($ISA), $(nproc) cores online, $THREADS threads each engine; load average before/after: $LOAD_BEFORE / $LOAD_AFTER."
    echo "llama.cpp: vendored in llama-cpp-python $LLAMA_CPP_PYTHON (commit $(cd "$LLAMA" && git rev-parse --short HEAD 2>/dev/null || echo unknown)), Release, GGML_NATIVE=ON."
    echo "mtp: repository at $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo unknown)$(cd "$REPO" && git diff --quiet HEAD 2>/dev/null || echo ' (tree with uncommitted changes)'), binaries $MTP_BIN_DIR (mtp-bench built $(date -u -r "$MTP_BENCH" +%Y-%m-%dT%H:%MZ))."
    echo "Model: Qwen3-0.6B shape, random weights (mtp synth --seed 1). $REPEATS repeats each, engines alternating; medians, [min-max]."
    echo
    "$PY" - "$RESULTS" "$TG_TOKENS" "$PP_TOKENS" "$BATCH" <<'EOF'
import statistics, sys
from collections import defaultdict
path, tg, pp, batch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
vals = defaultdict(list)
for line in open(path):
    row, engine, _, v = line.rstrip("\n").split("\t")
    vals[row, engine].append(float(v))
names = {
    "a": f"(a) decode B=1, bf16, tok/s ({tg} tokens)",
    "b": f"(b) decode B={batch} aggregate, bf16, tok/s ({tg} tokens each)",
    "c": f"(c) prefill, one {pp}-token prompt, bf16, tok/s",
    "d": f"(d) decode B=1, 4-bit (llama.cpp Q4_0, mtp MLX 4-bit g64), tok/s",
}
def cell(v):
    return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "n/a"
print("| row | llama.cpp median [min-max] | mtp median [min-max] | mtp/llama.cpp [min-max] |")
print("|---|---|---|---|")
for r in "abcd":
    l, m = vals[r, "llama.cpp"], vals[r, "mtp"]
    ratio = (f"{statistics.median(m) / statistics.median(l):.2f}x [{min(m) / max(l):.2f}-{max(m) / min(l):.2f}]"
             if l and m else "n/a")
    print(f"| {names[r]} | {cell(l)} | {cell(m)} | {ratio} |")
EOF
    echo
    echo "The ratio's spread is mtp's slowest over llama.cpp's fastest to mtp's fastest over llama.cpp's slowest."
    echo "How each side is timed:"
    echo "- llama.cpp: llama-bench (tg from an empty context, pp in one $PP_TOKENS-token batch; its default warm-up run first) and"
    echo "  llama-batched-bench (speed_tg: $BATCH sequences of 8 prompt tokens, $TG_TOKENS steps); forward passes on random ids, no sampling; f16 K/V."
    echo "- mtp: mtp-bench, plain decoding only (--drafters ''), greedy, after its untimed warm-up run; decode tok/s ="
    echo "  (tokens - requests) / (run seconds - prefill seconds), the first token of each request coming from its prefill;"
    echo "  prefill tok/s = $PP_TOKENS / prefill_seconds of the JSON (--prefill-chunk $MTP_PREFILL_CHUNK: tokens a forward);"
    echo "  greedy sampling and logprobs included; --kv-dtype $MTP_KV_DTYPE, --activations $MTP_ACTIVATIONS."
    echo
    [ -f "$WORKDIR/gguf-check.txt" ] && { cat "$WORKDIR/gguf-check.txt"; echo; }
    echo "Commands (RUN = $RUN; each repeat writes RUN/ROW-ENGINE-REPEAT.json):"
    echo
    echo '```'
    cat "$RUN/commands.txt"
    echo '```'
    echo
    echo "Setup $SETUP_SECONDS s, measuring $MEASURE_SECONDS s, total $((SECONDS - T0)) s."
} | tee "$RUN/table.md"
