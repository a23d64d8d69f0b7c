#!/usr/bin/env python3
"""Writes tests/fixtures/mlx: hf-tiny and trained checkpoints quantized by mlx-lm itself
(`mlx_lm.convert`, affine, several bits and group sizes, per-layer overrides in one), with
golden outputs recorded by mlx-lm: greedy tokens, the top-2 margin at every step, and the
logits after each prompt.

    python3 -m venv /tmp/mlx && /tmp/mlx/bin/pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"
    /tmp/mlx/bin/python scripts/make_mlx_fixtures.py

mlx runs on Linux CPUs (`mlx[cpu]`). Float32 scales and activations (`dtype="float32"`)
keep mlx's own arithmetic close to f32, so the golden logits compare tightly.
"""

import json
import os
import shutil
import subprocess

import mlx.core as mx
from mlx_lm import convert, load

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "mlx")
NEW_TOKENS = 24

# (name, source checkpoint, bits, group size, per-layer overrides)
MODELS = [
    ("qwen3-q4g32", "tests/fixtures/hf-tiny/qwen3-target", 4, 32, None),
    ("qwen3-q8g64", "tests/fixtures/hf-tiny/qwen3-target", 8, 64, None),
    # Llama's untied LM head is quantized too.
    ("llama-q4g32", "tests/fixtures/hf-tiny/llama-target", 4, 32, None),
    # Group size 128 needs rows of 128: a small checkpoint `mtp synth` writes.
    ("synth-q4g128", "synth", 4, 128, None),
    # Down projections at 8 bits, the rest at 4: mlx-lm's per-layer config entries.
    ("qwen2-q4g32-mixed", "tests/fixtures/hf-tiny/qwen2-target", 4, 32, "mixed"),
    ("trained-q4g64", "tests/fixtures/trained/target", 4, 64, None),
    # mxfp4: FP4 (E2M1) values with a power-of-two scale per 32, no biases.
    ("qwen3-mxfp4", "tests/fixtures/hf-tiny/qwen3-target", 4, 32, "mxfp4"),
]

# `mtp synth` (build it first: cargo build --release) writes the "synth" source.
SYNTH = ["--like", "qwen3", "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "64", "--intermediate", "512", "--vocab", "512", "--dtype", "f32", "--seed", "3"]

PROMPTS = {
    "hf-tiny": [[168, 488, 80, 205, 336], [27, 40, 423, 277, 51, 190, 301, 32, 468]],
    "trained": [[568, 2552, 286, 283], [264, 314, 532, 276, 271, 5469, 7547, 267, 542]],
}


def mixed(path, module):
    if "down_proj" in path:
        return {"group_size": 32, "bits": 8}
    return True


def record(path, prompts):
    model, _ = load(path)
    out = {"prompts": prompts, "new_tokens": NEW_TOKENS, "greedy": [], "margins": [], "prefill_last_logits": []}
    for p in prompts:
        logits = model(mx.array([p]))[0].astype(mx.float32)
        out["prefill_last_logits"].append([round(float(x), 6) for x in logits[-1].tolist()])
        seq, margins = list(p), []
        for _ in range(NEW_TOKENS):
            last = model(mx.array([seq]))[0, -1].astype(mx.float32)
            top = sorted(last.tolist(), reverse=True)
            margins.append(round(top[0] - top[1], 6))
            seq.append(int(mx.argmax(last).item()))
        out["greedy"].append(seq[len(p):])
        out["margins"].append(margins)
    return out


def prepared(src, tmp):
    """A copy of `src` that mlx-lm reads as transformers does: without an MTP head (which
    mlx-lm's Qwen3 does not load; the engine reads the head from the original checkpoint,
    left in bf16), and with `rope_theta` also at the top level (mlx-lm's Qwen2 and Llama
    ignore transformers 5's `rope_parameters` and would use their default base)."""
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    weights = mx.load(os.path.join(tmp, "model.safetensors"))
    mx.save_safetensors(os.path.join(tmp, "model.safetensors"),
                        {k: v for k, v in weights.items() if "mtp_layers" not in k}, {"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config.pop("num_nextn_predict_layers", None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tmp


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, src, bits, group, overrides in MODELS:
        dst = os.path.join(OUT, name)
        shutil.rmtree(dst, ignore_errors=True)
        if src == "synth":
            synth = "/tmp/mlx-fixture-synth"
            shutil.rmtree(synth, ignore_errors=True)
            subprocess.run([os.path.join(ROOT, "target", "release", "mtp"), "synth", *SYNTH, "--out", synth],
                           check=True)
            src = synth
        src_dir = prepared(os.path.join(ROOT, src), "/tmp/mlx-fixture-src")
        convert(src_dir, mlx_path=dst, quantize=True, q_bits=bits, q_group_size=group,
                q_mode="mxfp4" if overrides == "mxfp4" else "affine",
                dtype="float32", quant_predicate=mixed if overrides == "mixed" else None)
        for extra in ("README.md",):
            if os.path.exists(os.path.join(dst, extra)):
                os.remove(os.path.join(dst, extra))
        golden = record(dst, PROMPTS["trained" if name.startswith("trained") else "hf-tiny"])
        golden.update({"source": src, "bits": bits, "group_size": group, "overrides": overrides})
        with open(os.path.join(dst, "golden.json"), "w") as f:
            json.dump(golden, f)
        print(name, "written")


if __name__ == "__main__":
    main()
