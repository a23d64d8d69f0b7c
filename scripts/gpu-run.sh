#!/usr/bin/env bash
# On the GPU machine, from the repository root (no Rust or network there): unpacks the
# binaries `scripts/gpu-build.sh` packed, then
#   tests: every GPU test with MTP_TEST_BACKEND=cuda (golden, parity gate, invariance,
#          a suite named `name:bf16[:filter]` again with MTP_TEST_KV=bf16,
#          rollback, engine, kernel negative controls, prefix cache, the server); with
#          GPU_TESTS set, those suites only: the ten no longer fit one call's 64 MiB, so
#          build and run two halves, GPU_TESTS="gpu_invariance parity golden
#          model_invariance rollback" and "engine prefix_cache server quantized gemma4";
#   bench: the matmul against torch.matmul, and on synthesized Qwen3-0.6B / Qwen3-8B
#          shapes (bf16, random weights) B=1 decode of transformers eager beside mtp-bench
#          (plain, oracle:1.0 and oracle:0.7 at k=4 and adaptive k, batch 1 and 8);
#   gemma4-e2b, gemma4-31b-20: the same on a synthesized Gemma 4 E2B shape (all 35 layers)
#          or the 31B shape cut to 20 of its 60 layers (the disk holds 64 GiB), with
#          transformers' own Gemma4ForCausalLM as the anchor (a `cli` bundle suffices).
#   anchors: scripts/transformers_anchors.py (eager and static cache + torch.compile, B=1
#          and 8) on the Qwen3-0.6B and Qwen3-8B shapes (a `cli` bundle suffices).
#   ab:    two versions side by side (an `ab REV` bundle: mtp-bench-base and gpu_matmul-base
#          built from REV, mtp-bench and gpu_matmul from the tree): the matmul of each beside
#          torch.matmul, then mtp-bench alternated twice on the Qwen3-0.6B and Qwen3-8B
#          shapes: plain and oracle:1.0 k=4 decode at batch 1 and 8 (the tree's also with
#          AB_FLAGS, by default --no-cuda-graphs).
#   oracle: the speculative goals at partial acceptance on the Qwen3-8B shape: oracle:0.7 and
#          oracle:0.8, k=4, batch 1 and 8, beside plain (ORACLE_FLAGS: other drafters, k and
#          batches; a `cli` bundle suffices; an `ab REV` bundle runs the base's beside, twice).
#   long:  the prefill and long-context goals (a `cli` bundle suffices): mtp's prefill of a
#          2,048-token prompt on the Qwen3-8B shape beside transformers' (one forward), and
#          one layer's decode attention at 4k and 32k of context (the step's extra wall time,
#          and the attention launches' GPU time under ncu) beside PyTorch's
#          scaled_dot_product_attention (flash), by scripts/long_context_anchors.py.
#   matmul: the matmul the host picks at M = 1 to 4,096 on the 8B's shapes beside
#          torch.matmul (cuBLAS), one call (an `ab` or `all` bundle).
#   kernels: every tensor-core matmul kernel (passes, tiles, phase splits) timed at M = 1 to
#          512 on the three 8B shapes, the host's pick marked (an `ab` or `all` bundle).
#   profile-matmul: Nsight Compute's sections for one matmul launch at M = 1, 8, 40, 512 on
#          the 12288 x 4096 shape (where the time goes: bandwidth, L2, issue, stalls).
#   profile-wgmma: where the wgmma tiles' warps stall, instruction by instruction: Nsight
#          Compute's SASS samples of Wgmma128x192 at M = 4,096 and Wgmma128x128 at M = 512
#          on 12288 x 4096, summed by stall reason and opcode (scripts/ncu_sass_summary.py).
#   profile: on the Qwen3-0.6B and 8B shapes, B=1 (and 8B B=8) plain decode's wall time per
#          token beside the GPU time of each forward's kernels (ncu, one metric), by kernel.
#   tp:    tensor parallelism over every GPU of the machine (a kind with several): the
#          tensor_parallel suite on CUDA ranks, the reduction beside NCCL's all-reduce
#          (examples/gpu_collective.rs), and on the Qwen3-8B shape prefill of 2,048 tokens and
#          decode (plain and oracle:0.7 k=4, batch 1 and 8) at --tensor-parallel 1 and 2
#          (GPU_TESTS="tensor_parallel" bundle built with `all`).
#   numerics: the activation modes (bf16, the default; f32) side by side: the matmul at M = 1
#          to 4,096 beside cuBLAS, prefill of 2,048 and 16,384 tokens beside transformers,
#          decode and speculation (plain, oracle:1.0, oracle:0.7; k=4 and adaptive) on the
#          Qwen3-8B shape.
#   profile-prefill: the 8B shape's 2,048-token prefill, its GPU time by kernel (ncu).
#   stagger: a long prompt arriving while 8 rows decode on the 8B shape: the rows' round
#          time while it goes in and its time to first token (examples/staggered_prompt.rs;
#          with an `ab REV` bundle beside the base's).
#   quant: MLX-quantized weights against bf16 on the Qwen3-8B shape (`mtp synth --q-bits`,
#          4 and 8 bits in groups of 64): plain and oracle:1.0 k=4 decode at batch 1 and 8,
#          and a 2,048-token prefill, the checkpoints alternated twice, the 4-bit one also
#          with --activations f32 (a `cli` bundle suffices).
#   kv:    quantized K/V against bf16 K/V on the Qwen3-8B shape (bf16 weights): 8 prompts of
#          KV_CONTEXT (4,096) tokens at batch 8, and one at batch 1; prefill alone (one new
#          token) and with 128 more, so decode tok/s = new tokens / the difference; twice,
#          alternated (a `cli` bundle suffices).
#   prefill: the prefill goals (bf16 activations): the matmul at M = 128 to 4,096 beside
#          cuBLAS, the 8B shape's prefill of 2,048 tokens (PREFILL_TOKENS) beside
#          transformers; with an `ab REV` bundle also the base's prefill and decode.
#   serve: the serving goals on the Qwen3-8B shape through `mtp serve --backend cuda
#          --max-batch 64` (scripts/serve_bench.py, streamed, a sample checked bitwise
#          against the request alone): a burst of 128 requests from 64 clients sharing an
#          8,192-token prefix, the same prefix at 8 requests/s (Poisson), and a mix of
#          distinct 512-token prompts; needs a `cli` bundle (which packs the openai client's
#          wheels: the GPU machine has no network).
#   serve-storm: 1,000 requests at once (512-token prompts, 256 new) through `mtp serve
#          --max-batch 256 --kv-budget-mib 16384` on the same shape: rows outgrow the budget
#          and are preempted; every request must finish, a sample equal to alone.
#   serve-ab: the base and the tree side by side through the same server flags as `serve`
#          (an `ab REV` bundle): the shared-prefix burst alternated twice, the mix once
#          each, then the tree's shared prefix at 8 requests/s for 60 s (480 requests).
# Usage: scripts/gpu-run.sh tests|bench|all|serve|serve-ab|serve-storm|quant|kv|tp|gemma4-e2b|gemma4-31b-20|anchors|ab|oracle|long|numerics|prefill|profile-prefill|stagger|matmul|kernels|profile|profile-matmul|profile-wgmma. Logs go to $OUT
# (default /tmp/mtp-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
OUT="${OUT:-/tmp/mtp-gpu}"
mkdir -p "$OUT"
root="$PWD"
# The test binaries find fixtures under the path they were built at.
if [ "$root" != /work/main ]; then mkdir -p /work && ln -sfn "$root" /work/main; fi
bin=/tmp/mtp-bin/bin
rm -rf /tmp/mtp-bin && mkdir -p /tmp/mtp-bin
python3 -c "import tarfile; tarfile.open('gpu-bundle/bundle.tar.xz').extractall('/tmp/mtp-bin')" || exit 1
log="$OUT/gpu-tests.log"
summary="$OUT/summary.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$summary"
status=0
# NCCL (tensor parallelism): cudarc opens libnccl.so; pip's nvidia-nccl (beside PyTorch)
# ships libnccl.so.2 only, so a link to it goes on the library path.
if ! ldconfig -p 2>/dev/null | grep -q "libnccl.so "; then
    nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
    if [ -n "$nccl_lib" ] && [ -e "$nccl_lib/libnccl.so.2" ]; then
        mkdir -p /tmp/nccl-lib && ln -sf "$nccl_lib/libnccl.so.2" /tmp/nccl-lib/libnccl.so
        export LD_LIBRARY_PATH="/tmp/nccl-lib:${LD_LIBRARY_PATH:-}"
    fi
fi

torch_matmul() {
    python3 - <<'PY'
import torch
print("torch.matmul (cuBLAS), bf16 x bf16 -> bf16, median ms of 20 (4 weight copies in turn):")
print("| N x K | M | ms | weight GB/s |")
for n, k in [(4096, 4096), (12288, 4096), (4096, 12288)]:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for m in [1, 8, 40, 64, 128, 512, 4096]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ts = []
        for i in range(23):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); torch.matmul(x, ws[i % 4].t()); e.record(); torch.cuda.synchronize()
            if i >= 3: ts.append(s.elapsed_time(e))
        t = sorted(ts)[len(ts) // 2]
        print(f"| {n} x {k} | {m} | {t:.3f} | {n*k*2/t/1e6:.0f} |")
PY
}

if [ "$what" = tests ] || [ "$what" = all ]; then
    : > "$log"
    # GPU_TESTS picks suites (a bundle split in two to fit the 64 MiB a call carries).
    for t in ${GPU_TESTS:-golden parity model_invariance rollback engine gpu_invariance prefix_cache server quantized gemma4 constrained tools server_tools parity:bf16 gemma4:bf16:gate}; do
        # `name:KV[:FILTER]`: the suite again (its tests whose names hold FILTER) with its
        # models' K/V in KV (bf16: the f32 fixtures then take the tensor-core attention too;
        # FILTER leaves out the golden tests, whose tolerances are f32 K/V's).
        IFS=: read -r suite kv filter <<< "$t"
        echo "== $t" >> "$log"
        start=$(date +%s)
        (cd /work/main && MTP_TEST_BACKEND=cuda MTP_TEST_KV=${kv:-auto} "$bin/test-$suite" ${filter:-} --test-threads=1 --nocapture) >> "$log" 2>&1
        rc=$?
        res=$(grep -E "^test result" "$log" | tail -1)
        echo "$t: rc=$rc $(( $(date +%s) - start ))s $res" | tee -a "$summary"
        [ $rc -eq 0 ] || status=1
    done
    grep -E "panicked|FAILED|prefill logits within" "$log" | head -40 | tee -a "$summary"
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    blog="$OUT/gpu-bench.log"
    : > "$blog"
    "$bin/gpu_matmul" 2>&1 | tee -a "$blog"
    torch_matmul 2>&1 | tee -a "$blog"
    # Prompts cut from a folder that does not change with the engine, so runs compare.
    prompts="$root/training"
    for shape in 0.6b 8b; do
        dir=/tmp/qwen3-$shape
        if [ $shape = 0.6b ]; then
            "$bin/mtp" synth --like qwen3 --out $dir >> "$blog" 2>&1
        else
            "$bin/mtp" synth --like qwen3 --hidden 4096 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 \
                --intermediate 12288 --vocab 151936 --out $dir >> "$blog" 2>&1
        fi
        echo "== qwen3-$shape: transformers eager, B=1 greedy decode" | tee -a "$blog"
        python3 scripts/transformers_anchors.py $dir --modes eager --attn eager --batch 1 2>&1 | grep "tok/s" | tee -a "$blog"
        echo "== qwen3-$shape: mtp-bench --backend cuda" | tee -a "$blog"
        "$bin/mtp-bench" --target $dir --backend cuda --drafters oracle:1.0,oracle:0.7 --k 4,auto --batch 1,8 \
            --temperatures 0 --prompts-dir "$prompts" --num-prompts 8 --prompt-tokens 32 --max-tokens 64 --repeats 1 \
            --json "$OUT/bench-qwen3-$shape.json" 2>&1 | tee -a "$blog"
        rm -rf $dir
    done
    grep -E "^\||tok/s|device" "$blog" > "$OUT/bench-tables.txt"
fi

# Seconds of one `mtp generate` (after loading) on prompt file $1 with $2 new tokens and
# prefill chunk $3, on checkpoint $4 (further arguments: more flags).
mtp_seconds() {
    "$bin/mtp" generate --target "$4" --backend cuda --drafter none --max-batch 1 --prompts "$1" \
        --max-tokens "$2" --ignore-eos --prefill-chunk "$3" "${@:5}" 2>&1 >/dev/null |
        sed -n 's/.*seconds=\([0-9.e-]*\).*/\1/p' | tail -1
}

# A prompt file of $2 token ids at $1.
# prompt_of FILE TOKENS [PROMPTS]: PROMPTS (default 1) prompts of TOKENS ids, each its own
# (no prefix shared: the prefix cache cannot serve one from another).
prompt_of() {
    python3 -c "
import json
for p in range(${3:-1}): print(json.dumps({'id': f'p{p}', 'prompt_ids': [3 + (i + 7 * p) % 1000 for i in range($2)]}))" > "$1"
}

if [ "$what" = quant ]; then
    qlog="$OUT/quant.log"
    : > "$qlog"
    for q in bf16 4 8; do
        flags=(); [ $q = bf16 ] || flags=(--q-bits $q --q-group-size 64)
        "$bin/mtp" synth --like qwen3-8b "${flags[@]}" --out /tmp/qwen3-8b-$q > /dev/null || status=1
        du -sh /tmp/qwen3-8b-$q | tee -a "$qlog"
    done
    # `4:f32`: the 4-bit checkpoint with --activations f32 (the CUDA-core quantized matmul),
    # the tensor-core path's baseline in the same run.
    for round in 1 2; do
        for q in bf16 4 8 4:f32; do
            dir=${q%%:*}; act=auto; [ "$q" = "$dir" ] || act=${q#*:}
            echo "== qwen3-8b $q (round $round)" | tee -a "$qlog"
            "$bin/mtp-bench" --target /tmp/qwen3-8b-$dir --backend cuda --activations $act --drafters oracle:1.0 \
                --k 4 --batch 1,8 --temperatures 0 --prompts-dir "$root/training" --num-prompts 8 \
                --prompt-tokens 32 --max-tokens 64 --repeats 1 2>&1 | tee -a "$qlog"
        done
    done
    # Prefill of a 2,048-token prompt (first token only), twice each.
    prompt_of /tmp/p2048.jsonl 2048
    for round in 1 2; do
        for q in bf16 4 8 4:f32; do
            dir=${q%%:*}; act=auto; [ "$q" = "$dir" ] || act=${q#*:}
            s=$(mtp_seconds /tmp/p2048.jsonl 1 2048 /tmp/qwen3-8b-$dir --activations $act)
            echo "qwen3-8b $q: prefill 2048 tokens, round $round: $s s" | tee -a "$qlog"
        done
    done
    rm -rf /tmp/qwen3-8b-bf16 /tmp/qwen3-8b-4 /tmp/qwen3-8b-8
fi

if [ "$what" = kv ]; then
    klog="$OUT/kv.log"
    : > "$klog"
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b-kv > /dev/null || status=1
    ctx=${KV_CONTEXT:-4096}
    prompt_of /tmp/kv-8.jsonl "$ctx" 8
    prompt_of /tmp/kv-1.jsonl "$ctx" 1
    # kv_seconds PROMPTS BATCH NEW FLAGS...: the whole run's seconds.
    kv_seconds() {
        "$bin/mtp" generate --target /tmp/qwen3-8b-kv --backend cuda --drafter none --max-batch "$2" \
            --prompts "$1" --max-tokens "$3" --ignore-eos "${@:4}" 2>&1 >/dev/null |
            sed -n 's/.*seconds=\([0-9.e-]*\).*/\1/p' | tail -1
    }
    for round in 1 2; do
        for kv in bf16 q8 q4; do
            flags=(--kv-dtype bf16); [ $kv = bf16 ] || flags=(--kv-bits "${kv#q}")
            for b in 1 8; do
                t1=$(kv_seconds /tmp/kv-$b.jsonl $b 1 "${flags[@]}")
                t129=$(kv_seconds /tmp/kv-$b.jsonl $b 129 "${flags[@]}")
                python3 -c "
t1, t129, b = float('$t1' or 'nan'), float('$t129' or 'nan'), $b
print(f'K/V $kv, context $ctx, batch {b}, round $round: prefill {t1:.2f} s, decode {b * 128 / (t129 - t1):.1f} tok/s')" |
                    tee -a "$klog"
            done
        done
    done
    rm -rf /tmp/qwen3-8b-kv
fi

if [ "$what" = ab ]; then
    alog="$OUT/ab.log"
    for v in base new; do
        m="$bin/gpu_matmul"; [ $v = base ] && m="$bin/gpu_matmul-base"
        echo "== matmul $v" | tee -a "$alog"
        "$m" 2>&1 | tee -a "$alog"
    done
    torch_matmul 2>&1 | tee -a "$alog"
    "$bin/gpu_matmul" --stacked 2>&1 | tee -a "$alog"
    for shape in 0.6b 8b; do
        dir=/tmp/qwen3-$shape
        like=qwen3; [ $shape = 8b ] && like=qwen3-8b
        "$bin/mtp" synth --like $like --out $dir > /dev/null
        for round in 1 2; do
            # base, new, and new with AB_FLAGS (default: every kernel launched from the
            # host, no CUDA graphs).
            for v in base new eager; do
                b="$bin/mtp-bench"; [ $v = base ] && b="$bin/mtp-bench-base"
                flags=(); [ $v = eager ] && read -r -a flags <<< "${AB_FLAGS:---no-cuda-graphs}"
                echo "== qwen3-$shape $v (round $round)" | tee -a "$alog"
                "$b" --target $dir --backend cuda --drafters oracle:1.0 --k 4 --batch 1,8 --temperatures 0 \
                    --prompts-dir "$root/training" --num-prompts 8 --prompt-tokens 32 --max-tokens 64 --repeats 1 \
                    "${flags[@]}" 2>&1 | tee -a "$alog"
            done
        done
        rm -rf $dir
    done
fi

if [ "$what" = oracle ]; then
    # The speculative goals at partial acceptance: oracle:0.7 and 0.8, k=4, B=1 and 8, 8B shape
    # (ORACLE_FLAGS: other settings); with an `ab REV` bundle the base's beside, alternated.
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    read -r -a oflags <<< "${ORACLE_FLAGS:---drafters oracle:0.7,oracle:0.8 --k 4 --batch 1,8}"
    for round in 1 2; do
        for v in base new; do
            b="$bin/mtp-bench"; [ $v = base ] && b="$bin/mtp-bench-base"
            [ -x "$b" ] || continue
            echo "== $v (round $round)" | tee -a "$OUT/oracle.log"
            "$b" --target /tmp/qwen3-8b --backend cuda "${oflags[@]}" --temperatures 0 --prompts-dir "$root/training" \
                --num-prompts 8 --prompt-tokens 32 --max-tokens 64 --repeats 2 2>&1 | tee -a "$OUT/oracle.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        done
        [ -x "$bin/mtp-bench-base" ] || break
    done
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = anchors ]; then
    "$bin/mtp" synth --like qwen3 --out /tmp/qwen3-0.6b > /dev/null && "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    python3 scripts/transformers_anchors.py /tmp/qwen3-0.6b /tmp/qwen3-8b --batch 1 8 2>&1 | grep -v Warning | tee "$OUT/anchors.log"
    status=${PIPESTATUS[0]}
fi

if [ "$what" = tp ]; then
    tlog="$OUT/tp.log"
    nvidia-smi topo -m 2>&1 | tee -a "$tlog"
    if [ -x "$bin/test-tensor_parallel" ]; then
        (cd /work/main && MTP_TEST_BACKEND=cuda "$bin/test-tensor_parallel" --test-threads=1 --nocapture) >> "$tlog" 2>&1
        rc=$?
        echo "tensor_parallel: rc=$rc $(grep -E "^test result" "$tlog" | tail -1)" | tee -a "$summary"
        [ $rc -eq 0 ] || status=1
    fi
    "$bin/gpu_collective" 2>&1 | tee -a "$tlog"
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    for tokens in 2048 16384; do
        prompt_of /tmp/pp.jsonl $tokens
        for tp in 1 2; do
            for r in 1 2; do
                s=$(mtp_seconds /tmp/pp.jsonl 1 2048 /tmp/qwen3-8b --tensor-parallel $tp)
                echo "mtp prefill $tokens tokens, chunk 2048, --tensor-parallel $tp, run $r: $s s" | tee -a "$tlog"
            done
        done
    done
    for flags in "--tensor-parallel 1" "--tensor-parallel 1 --no-cuda-graphs" "--tensor-parallel 2"; do
        echo "== qwen3-8b $flags" | tee -a "$tlog"
        # shellcheck disable=SC2086
        "$bin/mtp-bench" --target /tmp/qwen3-8b --backend cuda $flags --drafters oracle:0.7 --k 4 --batch 1,8 \
            --temperatures 0 --prompts-dir "$root/training" --num-prompts 8 --prompt-tokens 32 --max-tokens 64 \
            --repeats 1 2>&1 | tee -a "$tlog"
    done
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = long ]; then
    llog="$OUT/long.log"
    # Prefill of a 2,048-token prompt on the 8B shape (first token only), 3 runs per chunk size.
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    prompt_of /tmp/p2048.jsonl 2048
    for chunk in 512 2048; do
        for r in 1 2 3; do
            s=$(mtp_seconds /tmp/p2048.jsonl 1 $chunk /tmp/qwen3-8b)
            echo "mtp prefill 2048 tokens, chunk $chunk, run $r: $s s" | tee -a "$llog"
        done
    done
    python3 scripts/long_context_anchors.py prefill /tmp/qwen3-8b --tokens 2048 2>&1 | grep -v Warning | tee -a "$llog"
    rm -rf /tmp/qwen3-8b
    # Attention at long context: one layer of the 8B shape; the decode step's extra time at
    # 4k and 32k of context over 32 is one layer's attention (and K/V store).
    "$bin/mtp" synth --like qwen3-8b --layers 1 --out /tmp/qwen3-8b-1 > /dev/null
    for ctx in 32 4096 32768; do
        prompt_of /tmp/pctx.jsonl $ctx
        s1=$(mtp_seconds /tmp/pctx.jsonl 1 512 /tmp/qwen3-8b-1)
        s65=$(mtp_seconds /tmp/pctx.jsonl 65 512 /tmp/qwen3-8b-1)
        echo "mtp 1 layer, context $ctx: $(python3 -c "print(f'{($s65 - $s1) / 64 * 1e6:.0f}')") us per decode step" | tee -a "$llog"
    done
    # The same decode steps' attention launches alone (the attention kernel and its merge:
    # `attention*` with f32 K/V, `flash*` with bf16, the default),
    # GPU time under ncu with real clocks: skip the prefill's launches (one a 512-token
    # chunk), then 8 decode steps.
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for ctx in 4096 32768; do
        prompt_of /tmp/pctx.jsonl $ctx
        "$ncu" --kernel-name 'regex:^(attention|flash)' --launch-skip $((ctx / 512)) --metrics gpu__time_duration.sum \
            --clock-control none --cache-control none --csv \
            "$bin/mtp" generate --target /tmp/qwen3-8b-1 --backend cuda --drafter none --max-batch 1 \
            --prompts /tmp/pctx.jsonl --max-tokens 9 --ignore-eos --prefill-chunk 512 > /tmp/ncu-att.csv 2>/dev/null
        python3 - /tmp/ncu-att.csv $ctx <<'PY' 2>&1 | tee -a "$llog"
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, rows = rows[0], rows[1:]
name, val = head.index("Kernel Name"), head.index("Metric Value")
ns = [float(r[val].replace(",", "")) for r in rows]
kinds = sorted({r[name].split("(")[0] for r in rows})
print(f"mtp attention, one decode query, context {sys.argv[2]}: {sum(ns) / 8 / 1e3:.1f} us per layer "
      f"(ncu, {len(ns)} launches over 8 steps: {', '.join(kinds)})")
PY
    done
    python3 scripts/long_context_anchors.py attention --keys 4096 32768 2>&1 | tee -a "$llog"
    rm -rf /tmp/qwen3-8b-1
fi

if [ "$what" = numerics ]; then
    # The activation modes side by side (bf16, the default, and f32): the matmul at M = 1 to
    # 4,096 beside cuBLAS, prefill of 2,048 and 16,384 tokens beside transformers, and
    # decode and speculation on the 8B shape (a `cli` or `all` bundle; `all` for the matmul).
    nlog="$OUT/numerics.log"
    [ -x "$bin/gpu_matmul" ] && "$bin/gpu_matmul" 2>&1 | tee -a "$nlog"
    [ -x "$bin/gpu_matmul" ] && torch_matmul 2>&1 | tee -a "$nlog"
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    for tokens in 2048 16384; do
        prompt_of /tmp/pp.jsonl $tokens
        for act in bf16 f32; do
            for r in $(seq $((tokens > 2048 ? 1 : 2))); do
                s=$(mtp_seconds /tmp/pp.jsonl 1 2048 /tmp/qwen3-8b --activations $act)
                echo "mtp prefill $tokens tokens, chunk 2048, $act activations, run $r: $s s" | tee -a "$nlog"
            done
        done
        python3 scripts/long_context_anchors.py prefill /tmp/qwen3-8b --tokens $tokens --runs 3 2>&1 | grep -v Warning | tee -a "$nlog"
    done
    for act in bf16 f32; do
        echo "== qwen3-8b, $act activations" | tee -a "$nlog"
        "$bin/mtp-bench" --target /tmp/qwen3-8b --backend cuda --activations $act --drafters oracle:1.0,oracle:0.7 \
            --k 4,auto --batch 1,8 --temperatures 0 --prompts-dir "$root/training" --num-prompts 8 \
            --prompt-tokens 32 --max-tokens 64 --repeats 2 2>&1 | tee -a "$nlog"
    done
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = prefill ]; then
    # The prefill goals, bf16 activations: the matmul at prefill sizes beside cuBLAS, and
    # the 8B shape's prefill of 2,048 tokens (PREFILL_TOKENS: more sizes) beside
    # transformers'; with an `ab REV` bundle, the base's prefill and both versions' plain
    # and oracle:1.0 k=4 decode (batch 1 and 8) alternated twice.
    plog="$OUT/prefill.log"
    "$bin/gpu_matmul" --m 128,256,512,2048,4096 2>&1 | tee -a "$plog"
    torch_matmul 2>&1 | tee -a "$plog"
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    for tokens in ${PREFILL_TOKENS:-2048}; do
        prompt_of /tmp/pp.jsonl $tokens
        # The seconds `mtp` (or `mtp-base`) takes to prefill the prompts of FILE in turn.
        prefill_seconds() {
            "$1" generate --target /tmp/qwen3-8b --backend cuda --drafter none --max-batch 1 \
                --prompts "$2" --max-tokens 1 --ignore-eos --prefill-chunk 2048 2>&1 >/dev/null |
                sed -n 's/.*seconds=\([0-9.e-]*\).*/\1/p' | tail -1
        }
        for r in 1 2; do
            for v in base new; do
                m="$bin/mtp"; [ $v = base ] && m="$bin/mtp-base"
                [ -x "$m" ] || continue
                echo "mtp prefill $tokens tokens, chunk 2048, $v, run $r: $(prefill_seconds "$m" /tmp/pp.jsonl) s" | tee -a "$plog"
            done
        done
        # Warm: three prompts in turn, the first one's run taken away (the process's first
        # forward maps its memory and loads its kernels; transformers' number is warm too).
        prompt_of /tmp/pp3.jsonl $tokens 3
        for v in base new; do
            m="$bin/mtp"; [ $v = base ] && m="$bin/mtp-base"
            [ -x "$m" ] || continue
            one=$(prefill_seconds "$m" /tmp/pp.jsonl)
            three=$(prefill_seconds "$m" /tmp/pp3.jsonl)
            echo "mtp prefill $tokens tokens, $v, warm: $(python3 -c "print(f'{($three - $one) / 2:.4f}')") s (1 prompt $one s, 3 prompts $three s)" | tee -a "$plog"
        done
        python3 scripts/long_context_anchors.py prefill /tmp/qwen3-8b --tokens $tokens --runs 3 2>&1 | grep -v Warning | tee -a "$plog"
    done
    if [ -x "$bin/mtp-bench-base" ]; then
        for round in 1 2; do
            for v in base new; do
                b="$bin/mtp-bench"; [ $v = base ] && b="$bin/mtp-bench-base"
                echo "== qwen3-8b $v (round $round)" | tee -a "$plog"
                "$b" --target /tmp/qwen3-8b --backend cuda --drafters oracle:1.0 --k 4 --batch 1,8 --temperatures 0 \
                    --prompts-dir "$root/training" --num-prompts 8 --prompt-tokens 32 --max-tokens 64 --repeats 1 \
                    2>&1 | tee -a "$plog"
            done
        done
    fi
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = profile-prefill ]; then
    # Where the 8B shape's 2,048-token prefill spends its GPU time: every kernel's time
    # (ncu, real clocks, warm caches), summed by kernel, beside the wall time.
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    prompt_of /tmp/pp.jsonl 2048
    gen=("$bin/mtp" generate --target /tmp/qwen3-8b --backend cuda --drafter none --max-batch 1
        --prompts /tmp/pp.jsonl --max-tokens 1 --ignore-eos --prefill-chunk 2048)
    echo "wall: $("${gen[@]}" 2>&1 >/dev/null | sed -n 's/.*seconds=\([0-9.e-]*\).*/\1/p' | tail -1) s" | tee -a "$OUT/profile-prefill.log"
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    "$ncu" --metrics gpu__time_duration.sum --clock-control none --cache-control none --csv -c 2000 \
        "${gen[@]}" > "$OUT/ncu-prefill.csv" 2>/dev/null
    python3 - "$OUT/ncu-prefill.csv" <<'PY' 2>&1 | tee -a "$OUT/profile-prefill.log"
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, rows = rows[0], rows[1:]
name, val = head.index("Kernel Name"), head.index("Metric Value")
agg, count = collections.Counter(), collections.Counter()
for r in rows:
    k = r[name].split("(")[0]
    agg[k] += float(r[val].replace(",", "")); count[k] += 1
print(f"{len(rows)} launches, {sum(agg.values()) / 1e6:.1f} ms of kernel time")
for k, v in agg.most_common(14):
    print(f"  {k}: {v / 1e6:.2f} ms ({count[k]} launches)")
PY
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = matmul ]; then
    # The picked kernel at M = 1 to 4,096 on the three 8B shapes, beside torch.matmul.
    "$bin/gpu_matmul" 2>&1 | tee "$OUT/matmul.md"
    torch_matmul 2>&1 | tee -a "$OUT/matmul.md"
fi

if [ "$what" = kernels ]; then
    "$bin/gpu_matmul" --kernels --m 1,8,16,32,40,64,128,512 2>&1 | tee "$OUT/matmul-kernels.md"
    "$bin/gpu_matmul" --stacked 2>&1 | tee -a "$OUT/matmul-kernels.md"
fi

if [ "$what" = profile-matmul ]; then
    # One launch of the matmul on the 12288 x 4096 shape at M = 1, 8, 40, 512 under Nsight
    # Compute's throughput, memory, occupancy and stall sections (an `ab` or `all` bundle).
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for m in 1 8 40 512; do
        "$ncu" --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
            --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
            -k regex:linear --launch-skip 3 --launch-count 1 \
            "$bin/gpu_matmul" --shapes 12288x4096 --m $m --reps 1 > "$OUT/ncu-matmul-m$m.txt" 2>&1
        echo "== M=$m" | tee -a "$OUT/profile-matmul.log"
        grep -E "linear|Duration|Throughput|Hit Rate|Occupancy|Registers Per|Issue Slots|Stall|Block Limit" \
            "$OUT/ncu-matmul-m$m.txt" | tee -a "$OUT/profile-matmul.log"
    done
fi

if [ "$what" = profile-wgmma ]; then
    # One launch of each tile under the source counters (an `ab` or `all` bundle); the
    # report's SASS page is kept gzipped beside the summary.
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for tile in Wgmma128x192:4096 Wgmma128x128:512; do
        kernel=${tile%%:*} m=${tile##*:}
        "$ncu" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
            -k regex:linear_wg --launch-skip 3 --launch-count 1 --export "$OUT/ncu-$kernel" -f \
            "$bin/gpu_matmul" --kernels --only $kernel --shapes 12288x4096 --m $m --reps 1 \
            > "$OUT/ncu-$kernel.txt" 2>&1 || status=1
        "$ncu" --import "$OUT/ncu-$kernel.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu-$kernel-sass.csv" 2>/dev/null || status=1
        echo "== $kernel, 12288 x 4096, M = $m" | tee -a "$OUT/profile-wgmma.log"
        grep -E "Duration|Compute \(SM\)|L2 Cache Throughput|Issue Slots|Warp Cycles Per Issued" \
            "$OUT/ncu-$kernel.txt" | tee -a "$OUT/profile-wgmma.log"
        python3 scripts/ncu_sass_summary.py "$OUT/ncu-$kernel-sass.csv" 12 2>&1 | tee -a "$OUT/profile-wgmma.log" || status=1
        gzip -f "$OUT/ncu-$kernel-sass.csv"
        rm -f "$OUT/ncu-$kernel.ncu-rep"
    done
fi

if [ "$what" = profile ]; then
    # like=launches (the ncu cap: 8 forwards at B=1, ~16 at B=8, prefills among them)=rows decoded together;
    # PROFILE_SHAPES replaces the list (qwen3-8b=17000=40: 40-token forwards, a B=8 k=4 verify's matmul
    # size, after 40 one-prompt prefills).
    for shape in ${PROFILE_SHAPES:-qwen3=2800=1 qwen3-8b=3600=1 qwen3-8b=7200=8}; do
        like=${shape%%=*}; rest=${shape#*=}; launches=${rest%=*}; batch=${rest#*=}
        dir=/tmp/profile-$like
        # PROFILE_SYNTH: more `mtp synth` flags (`--q-bits 4`: an MLX 4-bit checkpoint).
        [ -d $dir ] || "$bin/mtp" synth --like $like ${PROFILE_SYNTH:-} --out $dir > /dev/null
        echo "== $like B=$batch" | tee -a "$OUT/profile.log"
        python3 -c "
import json
for r in range($batch): print(json.dumps({'id': f'p{r}', 'prompt_ids': list(range(3 + r, 35 + r))}))" > /tmp/p.jsonl
        gen=("$bin/mtp" generate --target $dir --backend cuda --drafter none --max-batch $batch --prompts /tmp/p.jsonl --ignore-eos)
        "${gen[@]}" --max-tokens 200 2>&1 >/dev/null | grep -E "tokens_per_second" | tee -a "$OUT/profile.log"
        ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
        # Real clocks and warm caches: each kernel's time as in a run (not ncu's flushed-cache
        # upper bound), so the sum beside the wall time splits GPU time from launch and host time.
        "$ncu" --metrics gpu__time_duration.sum --clock-control none --cache-control none --csv -c $launches \
            "${gen[@]}" --max-tokens 8 > "$OUT/ncu-$like.csv" 2>/dev/null
        python3 - "$OUT/ncu-$like.csv" <<'PY' 2>&1 | tee -a "$OUT/profile.log"
import csv, sys, collections
# ncu's CSV lines are quoted; mtp's own stdout lines in the same file are not.
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, rows = rows[0], rows[1:]
name, val = head.index("Kernel Name"), head.index("Metric Value")
forwards, cur = [], None
for r in rows:
    k, ns = r[name].split("(")[0], float(r[val].replace(",", ""))
    if k.startswith("embed"):
        cur = collections.Counter(); forwards.append(cur)
    if cur is not None:
        cur[k] += ns; cur["#launches"] += 1
# The decode forwards: the last 7 but one (8 new tokens, the first from the prefill; the
# last forward may be cut by the cap).
decode = forwards[-7:-1] or forwards
total = sum(sum(v for k, v in f.items() if k != "#launches") for f in decode) / len(decode)
print(f"{len(forwards)} forwards profiled; per decode forward: {total / 1e3:.0f} us of kernel time, "
      f"{sum(f['#launches'] for f in decode) / len(decode):.0f} launches")
agg = collections.Counter()
for f in decode:
    agg.update(f)
count = collections.Counter(r[name].split("(")[0] for r in rows)
for k, v in agg.most_common(12):
    if k != "#launches":
        print(f"  {k}: {v / len(decode) / 1e3:.1f} us ({count[k] / len(forwards):.0f} launches a forward)")
PY
    done
    rm -rf /tmp/profile-*
fi

if [ "$what" = stagger ]; then
    # A long prompt arriving while 8 rows decode (examples/staggered_prompt.rs), base and
    # new alternated (an `ab REV` bundle: staggered_prompt-base).
    slog="$OUT/stagger.log"
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null
    for setting in ${STAGGER:-16384:2048 16384:512 2048:256}; do
        for round in 1 2; do
            for v in base new; do
                e="$bin/staggered_prompt"; [ $v = base ] && e="$bin/staggered_prompt-base"
                [ -x "$e" ] || continue
                echo "== $v (round $round)" | tee -a "$slog"
                "$e" --target /tmp/qwen3-8b --backend cuda --batch 9 --prompt-tokens ${setting%:*} \
                    --chunk ${setting#*:} --repeats 3 2>&1 | tee -a "$slog"
            done
        done
    done
    rm -rf /tmp/qwen3-8b
fi

if [ "$what" = serve ] || [ "$what" = serve-ab ] || [ "$what" = serve-storm ]; then
    v=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    mkdir -p /tmp/pylib
    for w in gpu-bundle/wheels/py$v/*.whl; do
        python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/pylib')" "$w"
    done
    export PYTHONPATH=/tmp/pylib
    "$bin/mtp" synth --like qwen3-8b --out /tmp/qwen3-8b > /dev/null || status=1
    serve="--target /tmp/qwen3-8b --backend cuda --max-batch 64 --prefix-cache-mib 16384"
    bench=(python3 scripts/serve_bench.py --binary "$bin/mtp" --url http://127.0.0.1:8311 "--serve=$serve"
        --concurrency 64 --ignore-eos --check-alone 8)
fi
if [ "$what" = serve-storm ]; then
    ulimit -n 8192
    python3 scripts/serve_bench.py --binary "$bin/mtp" --url http://127.0.0.1:8311 \
        --serve="--target /tmp/qwen3-8b --backend cuda --max-batch 256 --kv-budget-mib 16384 --max-pending 1024 --max-connections 1100 --max-connections-per-client 1100" \
        --workload shared-prefix --prefix-tokens 1 --own-tokens 512 --arrival burst --requests 1000 \
        --concurrency 1000 --max-tokens 256 --ignore-eos --check-alone 8 \
        --json "$OUT/serve-storm.json" 2>&1 | tee "$OUT/serve-storm.log" || status=1
    rm -rf /tmp/qwen3-8b
fi
if [ "$what" = serve-ab ]; then
    burst=(--workload shared-prefix --prefix-tokens 8192 --own-tokens 256 --arrival burst --requests 128 --max-tokens 128)
    mix=(--workload shared-prefix --prefix-tokens 1 --own-tokens 512 --arrival burst --requests 128 --max-tokens 256)
    # One workload through one binary: its table lines, the log and JSON kept in $OUT.
    serve_one() {
        local name=$1 binary=$2
        shift 2
        # (bench[4..]: the flags after its own --binary)
        python3 scripts/serve_bench.py --binary "$binary" "${bench[@]:4}" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
        echo "== $name ($binary)"
        grep -E 'output tokens/s|TTFT|inter-token|kv_bytes peak|bitwise|failed' "$OUT/$name.log"
    }
    for i in 1 2; do
        serve_one "burst-base$i" "$bin/mtp-base" "${burst[@]}"
        serve_one "burst-tree$i" "$bin/mtp" "${burst[@]}"
    done
    serve_one mix-base "$bin/mtp-base" "${mix[@]}"
    serve_one mix-tree "$bin/mtp" "${mix[@]}"
    serve_one poisson60-tree "$bin/mtp" --workload shared-prefix --prefix-tokens 8192 --own-tokens 256 \
        --arrival poisson --rate 8 --requests 480 --max-tokens 128
    rm -rf /tmp/qwen3-8b
fi
if [ "$what" = serve ]; then
    "${bench[@]}" --workload shared-prefix --prefix-tokens 8192 --own-tokens 256 --arrival burst \
        --requests 128 --max-tokens 128 --json "$OUT/serve-burst.json" 2>&1 | tee "$OUT/serve-burst.log" || status=1
    "${bench[@]}" --workload shared-prefix --prefix-tokens 8192 --own-tokens 256 --arrival poisson --rate 8 \
        --requests 160 --max-tokens 128 --json "$OUT/serve-poisson.json" 2>&1 | tee "$OUT/serve-poisson.log" || status=1
    "${bench[@]}" --workload shared-prefix --prefix-tokens 1 --own-tokens 512 --arrival burst \
        --requests 128 --max-tokens 256 --json "$OUT/serve-mix.json" 2>&1 | tee "$OUT/serve-mix.log" || status=1
    rm -rf /tmp/qwen3-8b
fi

if [[ "$what" == gemma4-* ]]; then
    blog="$OUT/gemma4-bench.log"
    dir=/tmp/$what
    case $what in
        gemma4-e2b) "$bin/mtp" synth --like gemma4-e2b --out $dir >> "$blog" 2>&1 ;;
        gemma4-31b-20) "$bin/mtp" synth --like gemma4-31b --layers 20 --max-gib 32 --out $dir >> "$blog" 2>&1 ;;
        *) echo "unknown: $what"; exit 2 ;;
    esac
    du -sh $dir | tee -a "$blog"
    echo "== $what: transformers eager, B=1 greedy decode" | tee -a "$blog"
    python3 scripts/transformers_anchors.py $dir --modes eager --attn eager --batch 1 2>&1 | grep "tok/s" | tee -a "$blog"
    echo "== $what: mtp-bench --backend cuda" | tee -a "$blog"
    "$bin/mtp-bench" --target $dir --backend cuda --drafters oracle:1.0,oracle:0.7 --k 4 --batch 1,8 \
        --temperatures 0 --prompts-dir "$root/training" --num-prompts 8 --prompt-tokens 32 --max-tokens 64 \
        --repeats 1 --json "$OUT/bench-$what.json" 2>&1 | tee -a "$blog"
    status=${PIPESTATUS[0]}
    rm -rf $dir
fi
exit $status
