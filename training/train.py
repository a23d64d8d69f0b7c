"""Step 2 of the recipe (GPU, about 8 minutes on one H100): trains the target, then the
MTP head and the draft model by distillation from the frozen target, evaluates on the
held-out text and writes the checkpoints (see export.py).

    python3 train.py --data data --out out [--target-steps N --distill-steps N]
"""
import argparse
import json
import lzma
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers as tf

import export
from models import CONTEXT, DRAFT, TARGET, MtpHead, qwen3_config, rope, step2_mask

SEED = 1234


def load_tokens(path):
    with lzma.open(path) as f:
        return torch.from_numpy(np.frombuffer(f.read(), dtype="<u2").astype(np.int64))


def batches(tokens, batch, seq, seed):
    """Random windows of seq + 1 tokens, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def windows(tokens, seq):
    """Non-overlapping windows covering `tokens` (evaluation)."""
    n = (tokens.numel() - 1) // seq
    return [tokens[i * seq:i * seq + seq + 1] for i in range(n)]


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def optimizer(params, lr):
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())


def kl(student_logits, teacher_logits):
    """KL(teacher || student), mean over tokens, in float32."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


class Log:
    def __init__(self, path):
        self.f = open(path, "a")

    def __call__(self, *msg):
        line = " ".join(str(m) for m in msg)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def train_target(model, data, val, args, log, dev):
    opt = optimizer(model.parameters(), args.target_lr)
    step_fn = torch.compile(model) if args.compile else model
    t0 = time.time()
    for step, xy in enumerate(batches(data, args.batch, CONTEXT, SEED)):
        if step == args.target_steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.target_steps, args.target_lr, 200)
        xy = xy.to(dev, non_blocking=True)
        with torch.autocast("cuda" if dev.type == "cuda" else "cpu", dtype=torch.bfloat16):
            logits = step_fn(input_ids=xy[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.target_steps - 1:
            log(f"target step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{time.time() - t0:.0f}s")
        if (step + 1) % args.val_every == 0:
            log(f"target step {step} val cross-entropy {val_loss(model, val, dev):.4f}")


@torch.no_grad()
def val_loss(model, tokens, dev, n=16):
    """Target cross-entropy on the first n validation windows (progress only)."""
    was = model.training
    model.eval()
    w = torch.stack(windows(tokens, CONTEXT)[:n]).to(dev)
    with torch.autocast("cuda" if dev.type == "cuda" else "cpu", dtype=torch.bfloat16):
        logits = model(input_ids=w[:, :-1]).logits
    model.train(was)
    return F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten()).item()


def train_distilled(target, head, draft, data, args, log, dev):
    """MTP head (two recursive steps) and draft model, both against the frozen target."""
    target.requires_grad_(False)
    params = list(head.parameters()) + list(draft.parameters())
    opt = optimizer(params, args.distill_lr)
    T = CONTEXT
    cos1, sin1 = rope(target.config, torch.arange(T), dev)
    cos2, sin2 = rope(target.config, torch.arange(1, T + 1), dev)
    mask = step2_mask(T - 2, dev)
    t0 = time.time()
    ac = torch.autocast("cuda" if dev.type == "cuda" else "cpu", dtype=torch.bfloat16)
    for step, xy in enumerate(batches(data, args.distill_batch, T, SEED + 1)):
        if step == args.distill_steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.distill_steps, args.distill_lr, 100)
        x = xy[:, :-1].to(dev, non_blocking=True)
        with ac:
            with torch.no_grad():
                hid = target.model(input_ids=x).last_hidden_state
                tlog = target.lm_head(hid)
                emb = target.model.embed_tokens(x)
            # Step 1: pair (h_i, t_{i+1}) predicts the target's distribution at i + 1.
            x1, k1, v1 = head.step1(hid[:, :-1], emb[:, 1:], cos1[:-1], sin1[:-1])
            l1 = kl(head.logits(x1, target.lm_head), tlog[:, 1:])
            # Step 2: (x1_i, t_{i+2}) at position i + 1 predicts the target at i + 2.
            n = T - 2
            x2 = head.step2(x1[:, :n], emb[:, 2:], k1[:, :, :n], v1[:, :, :n], cos2[:n], sin2[:n], mask)
            l2 = kl(head.logits(x2, target.lm_head), tlog[:, 2:])
            ld = kl(draft(input_ids=x).logits, tlog)
        loss = l1 + 0.5 * l2 + ld
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.distill_steps - 1:
            log(f"distill step {step} mtp1 {l1.item():.4f} mtp2 {l2.item():.4f} draft {ld.item():.4f} "
                f"{time.time() - t0:.0f}s")


@torch.no_grad()
def evaluate(target, head, draft, tokens, dev, max_windows=None):
    """Cross-entropy of the target, and how often the drafters' greedy choice equals the
    target's on this text (teacher-forced: MTP step 1, draft model)."""
    T = CONTEXT
    cos, sin = rope(target.config, torch.arange(T), dev)
    ce = n = agree_mtp = agree_draft = n_mtp = 0
    ws = windows(tokens, T)[:max_windows]
    for w in ws:
        w = w.to(dev)[None]
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast("cuda" if dev.type == "cuda" else "cpu", dtype=torch.bfloat16):
            hid = target.model(input_ids=x).last_hidden_state
            tlog = target.lm_head(hid).float()
            x1, _, _ = head.step1(hid[:, :-1], target.model.embed_tokens(x[:, 1:]), cos[:-1], sin[:-1])
            mlog = head.logits(x1, target.lm_head).float()
            dlog = draft(input_ids=x).logits.float()
        ce += F.cross_entropy(tlog[0], y[0], reduction="sum").item()
        n += y.numel()
        greedy = tlog.argmax(-1)
        agree_mtp += (mlog.argmax(-1) == greedy[:, 1:]).sum().item()
        n_mtp += greedy[:, 1:].numel()
        agree_draft += (dlog.argmax(-1) == greedy).sum().item()
    return {"cross_entropy": ce / n, "tokens": n, "mtp_agreement": agree_mtp / n_mtp,
            "draft_agreement": agree_draft / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", default="out")
    ap.add_argument("--target-steps", type=int, default=4000)
    ap.add_argument("--distill-steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--distill-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--distill-lr", type=float, default=2e-3)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=None, help="cap on evaluation windows (smoke tests)")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "train.log"))
    log(json.dumps(vars(args)))
    torch.manual_seed(SEED)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    log(f"torch {torch.__version__} transformers {tf.__version__} device {dev}")

    train, val, held = (load_tokens(os.path.join(args.data, f"{n}.u16.xz")) for n in ("train", "val", "heldout"))
    log(f"tokens: train {train.numel()} val {val.numel()} heldout {held.numel()}")
    vocab = json.load(open(os.path.join(args.data, "prepare.json"))).get("vocab", 8192)
    tcfg, dcfg = qwen3_config(vocab, TARGET), qwen3_config(vocab, DRAFT)
    target = tf.Qwen3ForCausalLM(tcfg).to(dev)
    draft = tf.Qwen3ForCausalLM(dcfg).to(dev)
    head = MtpHead(tcfg).to(dev)
    for name, m in [("target", target), ("draft", draft), ("mtp", head)]:
        log(f"{name}: {sum(p.numel() for p in m.parameters())} parameters")

    t0 = time.time()
    train_target(target, train, val, args, log, dev)
    target.eval()
    log(f"target trained in {time.time() - t0:.0f}s")
    train_distilled(target, head, draft, train, args, log, dev)
    head.eval()
    draft.eval()
    log(f"all trained in {time.time() - t0:.0f}s")
    report = {name: evaluate(target, head, draft, toks, dev, args.eval_windows)
              for name, toks in [("val", val), ("heldout", held)]}
    log("eval " + json.dumps(report))
    export.write_family(target, head, draft, args.data, args.out, report, log)


if __name__ == "__main__":
    main()
