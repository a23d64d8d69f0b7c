#!/usr/bin/env bash
# On a Mac with Apple Silicon (macOS 13+, Xcode command-line tools, Rust): the Metal
# backend's test suites on the real GPU, in one command. The same tests CI runs on the
# Metal emulator (.ci/run), with MTP_TEST_BACKEND=metal instead of metal-emulated: the
# kernels' bit invariance with its negative controls, agreement with the CPU, golden
# outputs against transformers, the parity gate, rollback, engine and Gemma 4.
# Usage: scripts/metal-test.sh [extra cargo test arguments, e.g. -- gate_qwen3]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" != Darwin ]; then
    echo "scripts/metal-test.sh runs on macOS; elsewhere: MTP_TEST_BACKEND=metal-emulated cargo test --release --features metal-emulator" >&2
    exit 1
fi
export MTP_TEST_BACKEND=metal
tests=(metal_invariance metal_source golden parity model_invariance rollback engine prefix_cache gemma4 quantized)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo test --release --features metal "${args[@]}" "$@"
