#!/usr/bin/env bash
# The Metal emulator's full matrix: the model-level suites CI runs on the emulator with
# every parity gate's drafter x k x max batch and every setting the rotated run leaves out
# (`MTP_TEST_MATRIX=full`, tests/common `full_matrix`; docs/testing.md, "CI"). Run it
# before landing a change to the Metal kernels, their bindings or the emulator (minutes
# in docs/testing.md). Extra arguments go to every cargo test, e.g. `--no-fail-fast`.
set -euxo pipefail
cd "$(dirname "$0")/.."
cargo test --release --features metal-emulator --test metal_invariance --test metal_source "$@"
cargo test --release --features metal-emulator --test cli "$@" -- metal_emulated
export MTP_TEST_BACKEND=metal-emulated MTP_TEST_MATRIX=full
cargo test --release --features metal-emulator --test golden --test model_invariance --test rollback \
    --test engine --test prefix_cache --test quantized --test gemma4 "$@"
cargo test --release --features metal-emulator --test parity "$@" -- gate_qwen3
