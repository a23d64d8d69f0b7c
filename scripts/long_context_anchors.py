"""The PyTorch side of the CUDA-speed issue's prefill and long-context goals, rerun beside
mtp by `scripts/gpu-run.sh long`:

    # transformers' prefill of one prompt (bf16, its default attention), median of 5
    python3 scripts/long_context_anchors.py prefill /tmp/qwen3-8b --tokens 2048
    # one decode query against L keys, scaled_dot_product_attention's flash backend
    python3 scripts/long_context_anchors.py attention --keys 4096 32768

Prefill time is one forward over the prompt that returns the last position's logits.
Attention is timed per layer with CUDA events, K/V rotated over 4 copies so that L2 does
not hold the keys being read (as the matmul bench rotates its weights).
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

p = argparse.ArgumentParser()
sub = p.add_subparsers(dest="what", required=True)
pf = sub.add_parser("prefill")
pf.add_argument("model")
pf.add_argument("--tokens", type=int, default=2048)
pf.add_argument("--runs", type=int, default=5)
at = sub.add_parser("attention")
at.add_argument("--keys", type=int, nargs="+", default=[4096, 32768])
at.add_argument("--heads", type=int, default=32)
at.add_argument("--kv-heads", type=int, default=8)
at.add_argument("--head-dim", type=int, default=128)
at.add_argument("--runs", type=int, default=50)
a = p.parse_args()


def median(xs):
    return sorted(xs)[len(xs) // 2]


if a.what == "prefill":
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, 1000, (1, a.tokens), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(a.runs + 2):  # two warm-up runs
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
    s = median(times)
    print(f"transformers prefill {a.tokens} tokens: {s * 1e3:.1f} ms ({a.tokens / s:.0f} tok/s), median of {a.runs}")
else:
    h, kvh, hd = a.heads, a.kv_heads, a.head_dim
    print("| keys | SDPA flash, one decode query, us per layer |")
    print("|---|---|")
    for n in a.keys:
        q = torch.randn(1, h, 1, hd, device="cuda", dtype=torch.bfloat16)
        kvs = [
            (torch.randn(1, kvh, n, hd, device="cuda", dtype=torch.bfloat16),
             torch.randn(1, kvh, n, hd, device="cuda", dtype=torch.bfloat16))
            for _ in range(4)
        ]
        # The flash backend with grouped heads where this PyTorch allows it, else K/V
        # expanded beforehand (outside the timing).
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, kvs[0][0], kvs[0][1], enable_gqa=True)

            def attend(k, v):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            how = "enable_gqa"
        except RuntimeError:
            kvs = [(k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)) for k, v in kvs]

            def attend(k, v):
                return F.scaled_dot_product_attention(q, k, v)
            how = "K/V expanded"
        times = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for i in range(a.runs + 3):
                k, v = kvs[i % 4]
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                attend(k, v)
                e.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(s.elapsed_time(e) * 1e3)
        print(f"| {n} | {median(times):.1f} ({how}) |")
