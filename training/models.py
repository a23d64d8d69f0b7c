"""The three trained models: target and draft (transformers' own Qwen3ForCausalLM) and
the MTP head, whose forward is written here to match model/src/models/llama/mtp.rs exactly:

    x   = input_proj([hidden_layernorm(h_i); token_layernorm(embed(t_{i+1}))])   (MiMo order)
    x'  = DecoderLayer(x)  at logical position i, causal over the head's own entries
    logits = lm_head(final_layernorm(x'))                                         (predicts t_{i+2})

`h_i` is the target's final-normed hidden state; embedding and LM head are the target's.
For a further draft the head runs again on (x', its own draft), one position later.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as tf
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

CONTEXT = 1024
TARGET = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
              head_dim=64, intermediate_size=1024)
DRAFT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, intermediate_size=768)


def qwen3_config(vocab, shape):
    return tf.Qwen3Config(vocab_size=vocab, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
                          rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_id=0, pad_token_id=0, initializer_range=0.02, **shape)


def rope(cfg, positions, device):
    """(cos, sin), each (T, head_dim), for integer positions: HF's default RoPE."""
    hd = cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    f = positions.to(device=device, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MtpHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.token_layernorm = Qwen3RMSNorm(h, eps)
        self.hidden_layernorm = Qwen3RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3DecoderLayer(cfg, layer_idx=0)
        self.final_layernorm = Qwen3RMSNorm(h, eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)

    def hf_state_dict(self):
        """Tensors under MiMo's names (`model.mtp_layers.0.*`)."""
        out = {}
        for k, v in self.state_dict().items():
            k = k.removeprefix("layer.")
            out[f"model.mtp_layers.0.{k}"] = v
        return out

    def inputs(self, hidden, emb):
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], -1))

    def qkv(self, x, cos, sin):
        a, (B, T, _) = self.layer.self_attn, x.shape
        n = self.layer.input_layernorm(x)
        q = a.q_norm(a.q_proj(n).view(B, T, -1, a.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(n).view(B, T, -1, a.head_dim)).transpose(1, 2)
        v = a.v_proj(n).view(B, T, -1, a.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, x, attn):
        """Residual adds and the MLP after attention output `attn` (B, heads, T, hd)."""
        B, _, T, _ = attn.shape
        x = x + self.layer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def step1(self, hidden, emb, cos, sin):
        """Entries at positions 0..T-1 (causal). Returns (block output, k, v)."""
        x = self.inputs(hidden, emb)
        q, k, v = self.qkv(x, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.finish(x, attn), k, v

    def step2(self, x1, emb, k1, v1, cos, sin, mask):
        """Recursive entries: entry i sits at position i + 1 (cos/sin for 1..T) and sees
        the step-1 entries 0..i plus itself, as a recursive draft does in inference."""
        x = self.inputs(x1, emb)
        q, k, v = self.qkv(x, cos, sin)
        attn = F.scaled_dot_product_attention(q, torch.cat([k1, k], 2), torch.cat([v1, v], 2),
                                              attn_mask=mask, enable_gqa=True)
        return self.finish(x, attn)

    def logits(self, x, lm_head):
        return lm_head(self.final_layernorm(x))


def step2_mask(T, device):
    """(T, 2T) bool: query i sees step-1 keys 0..i and its own step-2 key."""
    i = torch.arange(T, device=device)
    past = i[None, :] <= i[:, None]
    own = i[None, :] == i[:, None]
    return torch.cat([past, own], 1)


@torch.no_grad()
def mtp_drafts(target, head, prompt, k):
    """What the MTP drafter proposes after `prompt` (list of ids), as model/src/models/llama/mtp.rs and
    drafter/src/mtp.rs compute it: k greedy drafts and each step's top-2 logit margin."""
    dev = next(target.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    hid = target.model(input_ids=ids).last_hidden_state
    nxt = int(target.lm_head(hid[0, -1]).argmax())
    emb_fn = target.model.embed_tokens
    toks = list(prompt[1:]) + [nxt]
    xs = head.inputs(hid, emb_fn(torch.tensor([toks], device=dev)))
    drafts, margins = [], []
    for _ in range(k):
        T = xs.shape[1]
        cos, sin = rope(head.cfg, torch.arange(T), dev)
        q, kk, v = head.qkv(xs, cos, sin)
        attn = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
        out = head.finish(xs, attn)[:, -1:]
        lg = head.logits(out, target.lm_head)[0, -1]
        top = torch.topk(lg.float(), 2)
        d = int(top.indices[0])
        drafts.append(d)
        margins.append(float(top.values[0] - top.values[1]))
        xs = torch.cat([xs, head.inputs(out, emb_fn(torch.tensor([[d]], device=dev)))], 1)
    return drafts, margins
