#!/usr/bin/env bash
# Builds the GPU test binaries (`tests`), the CLIs alone (`cli`: mtp and mtp-bench, for
# measurements on synthesized checkpoints), the CLIs plus mtp-bench and the matmul bench as
# built from git revision REV (`ab REV`: side-by-side runs of two versions, `gpu-run.sh
# ab` or `prefill`; mtp-base too), or both and the matmul bench (`all`, the default) on a machine without a GPU (this
# one) and packs them into
# gpu-bundle/bundle.tar.xz, for `scripts/gpu-run.sh` on the GPU machine (which takes at
# most 64 MiB with the working tree: `tests` and `cli` keep the bundle small).
set -euo pipefail
what="${1:-all}"
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(scripts/install-nvcc.sh)}"
export NVCC
# GPU_TESTS (space-separated) packs some suites only: all ten no longer fit the 64 MiB a
# device call carries beside the tree, so `tests` is packed in two halves (see gpu-run.sh).
read -r -a tests <<< "${GPU_TESTS:-golden parity model_invariance rollback engine gpu_invariance prefix_cache server quantized gemma4 constrained tools server_tools parity:bf16 gemma4:bf16:gate}"
# A suite named `name:KV[:FILTER]` (rerun with MTP_TEST_KV=KV by gpu-run.sh) is built once,
# as `name`.
read -r -a tests <<< "$(for t in "${tests[@]}"; do echo "${t%%:*}"; done | awk '!seen[$0]++' | tr '\n' ' ')"
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo build --release --features cuda --bins --example gpu_matmul --example gpu_collective --example staggered_prompt
rm -rf gpu-bundle && mkdir -p gpu-bundle/bin
# `ab` packs test suites only when GPU_TESTS names them (one call can then test and compare).
[ "$what" = cli ] || { [ "$what" = ab ] && [ -z "${GPU_TESTS:-}" ]; } && tests=()
base_rev=""
[ "$what" = ab ] && base_rev="${2:?usage: scripts/gpu-build.sh ab REV}"
json=$([ ${#tests[@]} -eq 0 ] || cargo test --release --features cuda --no-run --message-format=json "${args[@]}")
for t in "${tests[@]}"; do
    exe=$(echo "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$t' and m.get('executable'):
        print(m['executable'])")
    cp "$exe" "gpu-bundle/bin/test-$t"
done
[ "$what" = cli ] || [ "$what" = tests ] || cp target/release/examples/gpu_matmul target/release/examples/gpu_collective gpu-bundle/bin/
[ "$what" = tests ] || cp target/release/examples/staggered_prompt gpu-bundle/bin/
[ "$what" = tests ] || cp target/release/mtp target/release/mtp-bench gpu-bundle/bin/
# The openai client for `gpu-run.sh serve` (the GPU machine has no network): wheels for
# the Pythons it may have, unpacked there.
if [ "$what" != tests ]; then
    for v in 3.10 3.11 3.12; do
        python3 -m pip download --quiet --only-binary=:all: --platform manylinux2014_x86_64 \
            --python-version "$v" -d "gpu-bundle/wheels/py$v" "openai==3.54.0" httpx
    done
fi
if [ -n "$base_rev" ]; then
    # The base version, from a worktree at REV, built in target/ab-base.
    base=/tmp/mtp-ab-base
    git worktree remove --force "$base" 2>/dev/null || rm -rf "$base"
    git worktree add --force --detach "$base" "$base_rev"
    # Measurement examples newer than REV are built against it as they are in the tree.
    [ -e "$base/examples/staggered_prompt.rs" ] || cp examples/staggered_prompt.rs "$base/examples/"
    (cd "$base" && CARGO_TARGET_DIR="$OLDPWD/target/ab-base" \
        cargo build --release --features cuda --bin mtp --bin mtp-bench --example gpu_matmul --example staggered_prompt)
    cp target/ab-base/release/mtp gpu-bundle/bin/mtp-base
    cp target/ab-base/release/mtp-bench gpu-bundle/bin/mtp-bench-base
    cp target/ab-base/release/examples/gpu_matmul gpu-bundle/bin/gpu_matmul-base
    cp target/ab-base/release/examples/staggered_prompt gpu-bundle/bin/staggered_prompt-base
    git worktree remove --force "$base"
fi
strip gpu-bundle/bin/* 2>/dev/null || true
XZ_OPT=-9e tar -C gpu-bundle -cJf gpu-bundle/bundle.tar.xz bin
rm -rf gpu-bundle/bin
ls -la gpu-bundle
