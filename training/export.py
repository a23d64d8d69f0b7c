"""Writes the trained family in the HF layout the Rust loader reads, plus golden outputs.

    OUT/target/  config.json (num_nextn_predict_layers: 1), generation_config.json,
                 model.safetensors (bf16; the MTP head inside, MiMo names), tokenizer.json,
                 golden.json
    OUT/draft/   the same without the MTP head
    OUT/samples.txt  greedy continuations of the held-out prompts

golden.json: transformers' float32 CPU results on the bf16 weights as stored: greedy tokens
with every step's top-2 logit margin, the logits after the prompt, and (target) the MTP
head's four recursive drafts after each prompt, computed by models.mtp_drafts.
"""
import copy
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
import transformers as tf
from tokenizers import Tokenizer

from models import MtpHead, mtp_drafts

GOLDEN_PROMPTS = 4
GOLDEN_TOKENS = 32
LOGIT_PROMPTS = 2
SAMPLE_TOKENS = 48


@torch.no_grad()
def greedy(model, prompt, n):
    """n greedy tokens with their top-2 margins, and the logits after the prompt."""
    past, x, out, margins, first = None, torch.tensor([prompt]), [], [], None
    for _ in range(n):
        o = model(input_ids=x, past_key_values=past, use_cache=True)
        past, logits = o.past_key_values, o.logits[0, -1].float()
        if first is None:
            first = logits
        top = torch.topk(logits, 2)
        margins.append(float(f"{float(top.values[0] - top.values[1]):.3g}"))
        out.append(int(top.indices[0]))
        x = torch.tensor([[out[-1]]])
    return out, margins, first


def save_checkpoint(model, extra, tok_path, d):
    """Saves a bf16 copy (the model itself, its RoPE buffers included, stays float32)."""
    copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(d, safe_serialization=True)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in extra.items()})
    save_file(dict(sorted(tensors.items())), path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    shutil.copy(tok_path, os.path.join(d, "tokenizer.json"))


def write_family(target, head, draft, data, out, report, log):
    tok_path = os.path.join(data, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "draft")
    save_checkpoint(target, head.hf_state_dict(), tok_path, tdir)
    save_checkpoint(draft, {}, tok_path, ddir)
    cfg_path = os.path.join(tdir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(cfg_path, "w"), indent=2)

    # Golden outputs in float32 on exactly the stored (bf16-rounded) weights: the
    # checkpoints as transformers loads them, and the head with its weights rounded.
    target = tf.AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    draft = tf.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    stored = MtpHead(target.config)
    stored.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()})
    head = stored.eval()
    prompts = [json.loads(l) for l in open(os.path.join(data, "heldout-prompts.jsonl"))]
    ids = [tok.encode(p["prompt"]).ids for p in prompts]
    for d, model, is_target in [(tdir, target, True), (ddir, draft, False)]:
        g = {"prompts": ids[:GOLDEN_PROMPTS], "new_tokens": GOLDEN_TOKENS, "greedy": [], "margins": [],
             "prefill_last_logits": []}
        for i, p in enumerate(g["prompts"]):
            toks, margins, first = greedy(model, p, GOLDEN_TOKENS)
            g["greedy"].append(toks)
            g["margins"].append(margins)
            if i < LOGIT_PROMPTS:
                g["prefill_last_logits"].append([round(v, 5) for v in first.tolist()])
            if is_target:
                drafts, dm = mtp_drafts(target, head, p, 4)
                g.setdefault("mtp_drafts", []).append(drafts)
                g.setdefault("mtp_margins", []).append([float(f"{m:.3g}") for m in dm])
        json.dump(g, open(os.path.join(d, "golden.json"), "w"))
    with open(os.path.join(out, "samples.txt"), "w") as f:
        for p, pid in zip(prompts, ids):
            toks, _, _ = greedy(target, pid, SAMPLE_TOKENS)
            f.write(f"=== {p['id']}\n--- prompt\n{p['prompt']}--- greedy continuation\n{tok.decode(toks)}\n")
    json.dump(report, open(os.path.join(out, "eval.json"), "w"), indent=1)
    log(f"wrote {tdir} and {ddir}")
