#!/usr/bin/env python3
"""Writes tests/fixtures/mlx: hf-tiny and trained checkpoints quantized by mlx-lm itself
(`mlx_lm.convert`, affine, several bits and group sizes, per-layer overrides in one), with
golden outputs recorded by mlx-lm: greedy tokens, the top-2 margin at every step, and the
logits after each prompt.

    python3 -m venv /tmp/mlx && /tmp/mlx/bin/pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"
    /tmp/mlx/bin/python scripts/make_mlx_fixtures.py [NAME ...]   # all, or the fixtures named

mlx runs on Linux CPUs (`mlx[cpu]`). Float32 scales and activations (`dtype="float32"`)
keep mlx's own arithmetic close to f32, so the golden logits compare tightly.
"""

import json
import os
import shutil
import subprocess
import sys

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
    # Gemma 4 as mlx-lm converts it. Text-only (`model.` names): the 31B-style dense target
    # (K = V on full layers) and the E-style target (quantized per-layer embedding table;
    # `per_layer_projection`, 16 wide, stays f32: mlx-lm skips rows a group does not divide).
    ("gemma4-dense-q4g32", "tests/fixtures/gemma4/gemma4-dense-target", 4, 32, None),
    ("gemma4-e-q4g32", "tests/fixtures/gemma4/gemma4-e-target", 4, 32, None),
    # The multimodal conversions (`gemma-4-26b-a4b-it-4bit` style): `language_model.model.`
    # names, stacked quantized experts (`experts.switch_glu.*`), the router at 8 bits g64
    # (mlx-lm's Gemma 4 rule) and down projections at 8 bits (per-layer config entries).
    ("gemma4-moe-mm-q4g32-mixed", "tests/fixtures/gemma4/gemma4-moe-target", 4, 32, "gemma4-mm"),
    # `gemma-4-31b-it-4bit` style: multimodal names, groups of 64, and the vision tower
    # tensors mlx-vlm keeps (added under its names; a text decoder must ignore them).
    ("gemma4-dense-mm-q4g64", "tests/fixtures/gemma4/gemma4-dense-target", 4, 64, "gemma4-mm"),
]

# `mtp synth` (build it first: cargo build --release) writes the "synth" source.
SYNTH = ["--like", "qwen3", "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "64", "--intermediate", "512", "--vocab", "512", "--dtype", "f32", "--seed", "3"]

PROMPTS = {
    "hf-tiny": [[168, 488, 80, 205, 336], [27, 40, 423, 277, 51, 190, 301, 32, 468]],
    "trained": [[568, 2552, 286, 283], [264, 314, 532, 276, 271, 5469, 7547, 267, 542]],
    # Gemma 4's tokenizer starts every prompt with BOS 2.
    "gemma4": [[2, 168, 488, 80, 205, 336], [2, 27, 40, 423, 277, 51, 190, 301, 32, 468]],
}


def mixed(path, module):
    if "down_proj" in path:
        return {"group_size": 32, "bits": 8}
    return True


def gemma4_mixed(path, module):
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}
    return mixed(path, module)


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
    if config.get("model_type") == "gemma4_text":
        # mlx-lm reads the full layers' shape from `global_head_dim` and
        # `num_global_key_value_heads`; transformers 5 writes them into `per_layer_config`.
        full = next(iter((config.get("per_layer_config") or {}).values()), {})
        config.setdefault("global_head_dim", full.get("head_dim", config["head_dim"]))
        if "num_key_value_heads" in full:
            config["num_global_key_value_heads"] = full["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tmp


def multimodal(tmp):
    """Rewrites the prepared text checkpoint in `tmp` as transformers saves the multimodal
    Gemma 4 (`Gemma4ForConditionalGeneration`): the text config under `text_config`,
    tensors under `model.language_model.`; mlx-lm renames them `language_model.model.`."""
    weights = mx.load(os.path.join(tmp, "model.safetensors"))
    mx.save_safetensors(os.path.join(tmp, "model.safetensors"),
                        {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()},
                        {"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        text = json.load(f)
    top = {k: text.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype",
                                      "transformers_version", "tie_word_embeddings") if k in text}
    text.pop("architectures", None)
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text, "vocab_size": text["vocab_size"], **top}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def add_vision_tower(dst):
    """mlx-vlm keeps the vision tower beside the language model (mlx-lm drops it): two
    tensors under mlx-vlm's names, so the fixture holds what a text decoder must skip."""
    path = os.path.join(dst, "model.safetensors")
    weights = mx.load(path)
    weights["vision_tower.patch_embedder.input_proj.weight"] = mx.zeros((64, 48), dtype=mx.float32)
    weights["embed_vision.embedding_projection.weight"] = mx.zeros((64, 64), dtype=mx.float32)
    mx.save_safetensors(path, weights, {"format": "mlx"})


def main():
    os.makedirs(OUT, exist_ok=True)
    only = sys.argv[1:]
    for name, src, bits, group, overrides in MODELS:
        if only and name not in only:
            continue
        dst = os.path.join(OUT, name)
        shutil.rmtree(dst, ignore_errors=True)
        if src == "synth":
            synth = "/tmp/mlx-fixture-synth"
            shutil.rmtree(synth, ignore_errors=True)
            subprocess.run([os.path.join(ROOT, "target", "release", "mtp"), "synth", *SYNTH, "--out", synth],
                           check=True)
            src = synth
        src_dir = prepared(os.path.join(ROOT, src), "/tmp/mlx-fixture-src")
        if overrides == "gemma4-mm":
            multimodal(src_dir)
        predicate = {"mixed": mixed}.get(overrides)
        if overrides == "gemma4-mm" and name.endswith("-mixed"):
            predicate = gemma4_mixed
        convert(src_dir, mlx_path=dst, quantize=True, q_bits=bits, q_group_size=group,
                q_mode="mxfp4" if overrides == "mxfp4" else "affine",
                dtype="float32", quant_predicate=predicate)
        if overrides == "gemma4-mm" and not name.endswith("-mixed"):
            add_vision_tower(dst)
        for extra in ("README.md",):
            if os.path.exists(os.path.join(dst, extra)):
                os.remove(os.path.join(dst, extra))
        family = next((f for f in ("trained", "gemma4") if name.startswith(f)), "hf-tiny")
        golden = record(dst, PROMPTS[family])
        golden.update({"source": src, "bits": bits, "group_size": group, "overrides": overrides})
        with open(os.path.join(dst, "golden.json"), "w") as f:
            json.dump(golden, f)
        print(name, "written")


if __name__ == "__main__":
    main()
