#!/usr/bin/env bash
# Builds the GPU test binaries (`tests`), the CLIs alone (`cli`: mtp and mtp-bench, for
# measurements on synthesized checkpoints) or both and the matmul bench (`all`, the
# default) on a machine without a GPU (this one) and packs them into
# gpu-bundle/bundle.tar.xz, for `scripts/gpu-run.sh` on the GPU machine (which takes at
# most 64 MiB with the working tree: `tests` and `cli` keep the bundle small).
set -euo pipefail
what="${1:-all}"
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(scripts/install-nvcc.sh)}"
export NVCC
tests=(golden parity model_invariance rollback engine gpu_invariance prefix_cache server quantized gemma4)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo build --release --features cuda --bins --example gpu_matmul
rm -rf gpu-bundle && mkdir -p gpu-bundle/bin
[ "$what" = cli ] && tests=()
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
if [ "$what" = all ]; then
    cp target/release/mtp target/release/mtp-bench target/release/examples/gpu_matmul gpu-bundle/bin/
elif [ "$what" = cli ]; then
    cp target/release/mtp target/release/mtp-bench gpu-bundle/bin/
fi
strip gpu-bundle/bin/* 2>/dev/null || true
XZ_OPT=-9e tar -C gpu-bundle -cJf gpu-bundle/bundle.tar.xz bin
rm -rf gpu-bundle/bin
ls -la gpu-bundle
