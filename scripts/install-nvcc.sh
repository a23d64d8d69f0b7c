#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler the `cuda` feature builds its kernels with (from PyPI,
# pinned to match the H100 machine's CUDA 13.0 driver) into a virtual environment, and
# prints the nvcc path to export as NVCC. No GPU needed.
set -euo pipefail
venv="${MTP_NVCC_VENV:-$HOME/.cache/mtp-nvcc}"
nvcc="$venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc"
if ! ls $nvcc >/dev/null 2>&1; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 >&2
fi
ls $nvcc
