"""An EAGLE-3 head for the shipped target (tests/fixtures/trained/target), trained by
distillation from it, in the SafeAILab / SGLang layout that `--drafter eagle3` loads.

    python3 eagle3.py data --out e3data                  # CPU: tokens of the corpus
    python3 eagle3.py train --data e3data --out e3out    # CPU, 2 cores: 22 min (the shipped head)

`data` tokenizes the training corpus (corpus.py's rule, this machine's cargo registry)
with the shipped tokenizer, every 100th file held back for validation as prepare.py does,
and keeps the first --max-tokens of each split. `train` reads the frozen target, trains
the head and writes `e3out/eagle3/` (config.json, model.safetensors) and `e3out/eval.json`.

The forward is the one model/src/models/llama/eagle3.rs runs (and
tests/fixtures/eagle3/make_fixture.py checks in numpy), for target states `taps_i` (the
residual stream entering layers 1, 3 and 5, SGLang's `eagle_aux_hidden_state_layer_ids`
[0, 2, 4]) and token `t_{i+1}`:

    g   = fc(cat(taps_i))                       first step; later steps: the head's own x
    x   = g + o(attn(qkv(cat(input_layernorm(embed(t)), hidden_norm(g)))))
    x   = x + mlp(post_attention_layernorm(x))
    out = lm_head(norm(x))  over the draft vocabulary (the 2,048 most frequent tokens)

Training unrolls three steps as inference drafts them (EAGLE-3's training-time test):
step j's entry for origin o sits at position o + j - 1, reads the step-1 entries at
positions <= o and its own chain's earlier steps, and is scored by KL against the
target's distribution at o + j restricted to the draft vocabulary (weights 1, 0.8, 0.64).
The embedding is the target's (frozen; the head has none of its own).
"""
import argparse
import json
import lzma
import math
import os
import time

import numpy as np

SEED = 1234
TAP_LAYER_OUTPUTS = [0, 2, 4]  # SGLang's ids: the inputs of layers 1, 3 and 5 are tapped
DRAFT_VOCAB = 2048
INTERMEDIATE = 512
STEPS = 3
STEP_WEIGHT = 0.8
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "..", "tests", "fixtures", "trained", "target")


def data(args):
    from tokenizers import Tokenizer

    import corpus

    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    docs = corpus.select_corpus()
    os.makedirs(args.out, exist_ok=True)
    for name, keep in [("train", lambda i: i % 100 != 0), ("val", lambda i: i % 100 == 0)]:
        ids, n = [], 0
        texts = [t for i, (_, t) in enumerate(docs) if keep(i)]
        # A seeded shuffle, so that a cap on tokens still spans every crate.
        texts = [texts[i] for i in np.random.default_rng(SEED).permutation(len(texts))]
        for start in range(0, len(texts), 256):
            for enc in tok.encode_batch(texts[start:start + 256]):
                ids.append(np.asarray(enc.ids + [0], dtype="<u2"))
                n += len(enc.ids) + 1
            if n >= args.max_tokens:
                break
        arr = np.concatenate(ids)[:args.max_tokens]
        with lzma.open(os.path.join(args.out, f"{name}.u16.xz"), "wb", preset=6) as f:
            f.write(arr.tobytes())
        print(name, arr.size, "tokens")


def train(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import transformers as tf
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ac = torch.autocast(dev.type, dtype=torch.bfloat16)
    target = tf.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(dev).eval()
    target.requires_grad_(False)
    cfg = target.config
    h, heads, kv_heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    taps_at = [i + 1 for i in sorted(TAP_LAYER_OUTPUTS)]

    def load(name):
        with lzma.open(os.path.join(args.data, f"{name}.u16.xz")) as f:
            return torch.from_numpy(np.frombuffer(f.read(), dtype="<u2").astype(np.int64))

    train_tokens, val_tokens = load("train"), load("val")
    counts = torch.bincount(train_tokens, minlength=cfg.vocab_size)
    draft_ids = torch.sort(torch.topk(counts, DRAFT_VOCAB).indices).values
    print(f"draft vocabulary covers {counts[draft_ids].sum().item() / counts.sum().item():.3f} of the training tokens")

    class RMSNorm(nn.Module):
        def __init__(self, init=None):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h) if init is None else init.float().clone())

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * self.weight).to(x.dtype)

    def linear(i, o):
        m = nn.Linear(i, o, bias=False)
        nn.init.normal_(m.weight, std=0.02)
        return m

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = linear(3 * h, h)
            self.input_layernorm, self.hidden_norm = RMSNorm(), RMSNorm()
            self.q, self.k, self.v = linear(2 * h, heads * hd), linear(2 * h, kv_heads * hd), linear(2 * h, kv_heads * hd)
            self.o = linear(heads * hd, h)
            self.post_attention_layernorm = RMSNorm()
            self.gate, self.up, self.down = linear(h, INTERMEDIATE), linear(h, INTERMEDIATE), linear(INTERMEDIATE, h)
            self.norm = RMSNorm(target.model.norm.weight.detach())
            self.lm_head = nn.Linear(h, DRAFT_VOCAB, bias=False)
            self.lm_head.weight.data.copy_(target.lm_head.weight.detach()[draft_ids.to(dev)].float())

        def qkv(self, g, emb, positions):
            B, T, _ = g.shape
            cat = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)
            cos, sin = rope(positions)
            q = rotate(self.q(cat).view(B, T, heads, hd).transpose(1, 2), cos, sin)
            k = rotate(self.k(cat).view(B, T, kv_heads, hd).transpose(1, 2), cos, sin)
            return q, k, self.v(cat).view(B, T, kv_heads, hd).transpose(1, 2)

        def finish(self, g, attn):
            B, _, T, _ = attn.shape
            x = g + self.o(attn.transpose(1, 2).reshape(B, T, -1))
            n = self.post_attention_layernorm(x)
            return x + self.down(F.silu(self.gate(n)) * self.up(n))

        def logits(self, x):
            return self.lm_head(self.norm(x))

    def rope(positions):
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev) / hd)
        f = positions.to(dev, torch.float32)[:, None] * inv[None]
        e = torch.cat([f, f], -1)
        return e.cos(), e.sin()

    def rotate(x, cos, sin):
        a, b = x.chunk(2, -1)
        return (x.float() * cos + torch.cat([-b, a], -1).float() * sin).to(x.dtype)

    def unrolled(head, x):
        """Per step j (1..STEPS): the head's draft logits for origins 0..T-1-j and the
        target's restricted log-distribution they are scored against."""
        B, T = x.shape
        with torch.no_grad():
            out = target.model(input_ids=x, output_hidden_states=True)
            taps = torch.cat([out.hidden_states[i] for i in taps_at], -1)
            # The target's logits over the draft vocabulary only (its LM head's rows for it).
            teacher = out.last_hidden_state @ target.lm_head.weight[draft_ids.to(dev)].T
            emb = target.model.embed_tokens(x)
        keys, values, results = [], [], []
        g = head.fc(taps[:, :T - 1])
        for j in range(1, STEPS + 1):
            n = T - j  # origins 0..n-1; the entry for origin o sits at position o + j - 1
            g = g[:, :n]
            q, k, v = head.qkv(g, emb[:, j:j + n], torch.arange(j - 1, j - 1 + n))
            o = torch.arange(n, device=dev)
            # Step-1 keys at positions <= o, then the chain's own entries of steps 2..j.
            ks, vs = [kk[:, :, :n] for kk in keys[1:]], [vv[:, :, :n] for vv in values[1:]]
            if j == 1:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                first = torch.arange(T - 1, device=dev)
                masks = [first[None, :] <= o[:, None]] + [o[None, :] == o[:, None]] * (j - 1)
                attn = F.scaled_dot_product_attention(
                    q, torch.cat([keys[0]] + ks + [k], 2), torch.cat([values[0]] + vs + [v], 2),
                    attn_mask=torch.cat(masks, 1), enable_gqa=True)
            keys.append(k)
            values.append(v)
            g = head.finish(g, attn)
            results.append((head.logits(g), teacher[:, j:j + n]))
        return results

    head = Head().to(dev)
    params = [p for p in head.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(SEED)
    t0 = time.time()
    trained = 0
    for step in range(args.steps):
        if time.time() - t0 > args.max_seconds:
            print(f"stopped at step {step}: --max-seconds {args.max_seconds}", flush=True)
            break
        lr = args.lr * (step + 1) / 100 if step < 100 else args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 100) / max(1, args.steps - 100))))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_tokens.numel() - args.seq, (args.batch,), generator=g)
        x = torch.stack([train_tokens[s:s + args.seq] for s in starts.tolist()]).to(dev)
        with ac:
            losses = []
            for student, teacher in unrolled(head, x):
                t = F.log_softmax(teacher.float(), -1)
                losses.append((t.exp() * (t - F.log_softmax(student.float(), -1))).sum(-1).mean())
        loss = sum(STEP_WEIGHT ** i * l for i, l in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        trained += 1
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} " + " ".join(f"kl{j + 1} {l.item():.4f}" for j, l in enumerate(losses))
                  + f" lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)

    # Teacher-forced agreement with the target's greedy token, per step, on validation.
    head.eval()
    agree, total = [0] * STEPS, [0] * STEPS
    with torch.no_grad(), ac:
        n_windows = min(64, (val_tokens.numel() - 1) // args.seq)
        for w in range(0, n_windows, 8):
            x = torch.stack([val_tokens[(w + i) * args.seq:(w + i + 1) * args.seq] for i in range(8)]).to(dev)
            for j, (student, teacher) in enumerate(unrolled(head, x)):
                agree[j] += (student.argmax(-1) == teacher.argmax(-1)).sum().item()
                total[j] += student.shape[0] * student.shape[1]
    report = {"steps": trained, "batch": args.batch, "seq": args.seq, "seconds": round(time.time() - t0, 1),
              "draft_vocab": DRAFT_VOCAB,
              "greedy_agreement_by_step": [round(a / max(1, t), 4) for a, t in zip(agree, total)]}
    print(json.dumps(report))

    out = os.path.join(args.out, "eagle3")
    os.makedirs(out, exist_ok=True)
    names = {"fc": "fc", "q": "midlayer.self_attn.q_proj", "k": "midlayer.self_attn.k_proj",
             "v": "midlayer.self_attn.v_proj", "o": "midlayer.self_attn.o_proj",
             "gate": "midlayer.mlp.gate_proj", "up": "midlayer.mlp.up_proj", "down": "midlayer.mlp.down_proj",
             "input_layernorm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
             "post_attention_layernorm": "midlayer.post_attention_layernorm", "norm": "norm", "lm_head": "lm_head"}
    tensors = {f"{names[k.removesuffix('.weight')]}.weight": v.detach().cpu().to(torch.bfloat16).contiguous()
               for k, v in head.state_dict().items()}
    ids = draft_ids.cpu().to(torch.int64)
    tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": INTERMEDIATE, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": eps, "rope_theta": theta, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": h,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAP_LAYER_OUTPUTS, "use_aux_hidden_state": True},
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--target", default=TARGET)
    d.add_argument("--out", default="e3data")
    d.add_argument("--max-tokens", type=int, default=3_000_000)
    t = sub.add_parser("train")
    t.add_argument("--target", default=TARGET)
    t.add_argument("--data", default="e3data")
    t.add_argument("--out", default="e3out")
    t.add_argument("--steps", type=int, default=1200)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--max-seconds", type=float, default=float("inf"), help="stop training (and export) after this long")
    args = ap.parse_args()
    data(args) if args.cmd == "data" else train(args)


if __name__ == "__main__":
    main()
