"""The transformers anchors of the CUDA-speed work: decode tokens/s of HF transformers on a
checkpoint (bf16, greedy, random-weight synth shapes from `mtp synth`), eager and with a
static cache + torch.compile (reduce-overhead: CUDA graphs), at each batch size, beside the
bandwidth limit (weight bytes / 3.0 TB/s). Rerun, not copied:

    mtp synth --like qwen3 --out /tmp/qwen3-0.6b && mtp synth --like qwen3-8b --out /tmp/qwen3-8b
    python3 scripts/transformers_anchors.py /tmp/qwen3-0.6b /tmp/qwen3-8b --batch 1 8

Decode rate = batch * (new - 1) / (t(new) - t(1)): prefill and the first token excluded.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, CompileConfig

p = argparse.ArgumentParser()
p.add_argument("models", nargs="+")
p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
p.add_argument("--prompt", type=int, default=32)
p.add_argument("--new", type=int, default=65)
p.add_argument("--modes", default="eager,compile")
p.add_argument("--attn", default=None, help="attn_implementation (default: transformers' own choice)")
p.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s for the limit column")
a = p.parse_args()

rows = []
for path in a.models:
    extra = {"attn_implementation": a.attn} if a.attn else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **extra).cuda().eval()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    limit = a.bandwidth / weights
    for mode in a.modes.split(","):
        kwargs = dict(do_sample=False, pad_token_id=0)
        if mode == "compile":
            # generate() compiles the decode step itself with a static cache (CUDA graphs).
            kwargs["cache_implementation"] = "static"
            kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        for b in a.batch:
            ids = torch.randint(3, 1000, (b, a.prompt), device="cuda")

            def gen(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
                torch.cuda.synchronize()
                return time.perf_counter() - t

            for _ in range(2):  # warm up (compilation, graph capture)
                gen(a.new)
            rate = b * (a.new - 1) / (gen(a.new) - gen(1))
            rows.append((path, mode, b, rate, limit))
            print(f"{path} {mode} B={b}: {rate:.1f} tok/s (limit at B=1: {limit:.0f})", flush=True)

print("| checkpoint | mode | batch | decode tok/s | bandwidth limit, B=1 |")
print("|---|---|---|---|---|")
for path, mode, b, rate, limit in rows:
    print(f"| {path} | {mode} | {b} | {rate:.1f} | {limit:.0f} |")
