#!/usr/bin/env python3
"""Converts a Hugging Face Qwen3, Qwen2 or Llama checkpoint to GGUF for llama.cpp, without torch or
transformers: only numpy and the `gguf` package of the llama.cpp tree you run it with.

    PYTHONPATH=LLAMA_CPP/gguf-py python3 scripts/gguf_from_hf.py CHECKPOINT_DIR OUT.gguf [--pre NAME]

Reads from CHECKPOINT_DIR:
- config.json: the hyperparameters (`model_type` must be `qwen3`, `qwen2` or `llama`);
- model.safetensors, or model.safetensors.index.json and its shards: read directly (an
  8-byte little-endian header length, a JSON header, then raw data) through a memory map;
- tokenizer.json: a byte-level BPE tokenizer (vocabulary, added tokens, merges);
- generation_config.json, if present: its bos/eos ids win over config.json's;
- chat_template.jinja, else tokenizer_config.json's `chat_template` string, if present (or
  the file `--chat-template` names): written as `tokenizer.chat_template`.

Writes a GGUF with arch `qwen3`, `qwen2` or `llama`. Matrices keep their dtype (BF16, F16 or F32; BF16 is
copied bit for bit as u16); 1-D tensors (the norms) are widened to F32, as llama.cpp's own
converter does. A tied LM head (`tie_word_embeddings`) is written as no `output.weight`:
llama.cpp then reuses `token_embd.weight`. Tensor names are llama.cpp's (`token_embd`,
`blk.N.attn_q`, `blk.N.attn_q_norm`, `blk.N.ffn_gate`, `output_norm`, `output`, ...), taken
from the gguf package's constants and checked against its tensor-name map. Qwen2's q/k/v
biases go in as F32. For `llama`, the q and k rows (and biases) of each head are permuted
as llama.cpp's own converter does (`LlamaModel.permute`: a head's rows `[2, hd/2]` stored
as `[hd/2, 2]`), since llama.cpp's llama rotates adjacent pairs. An MTP head
(`mtp_layers.*`, which llama.cpp's qwen3 does not read) is left out with a note.

The pre-tokenizer name (`tokenizer.ggml.pre`, which selects llama.cpp's splitting regex) is
read off tokenizer.json: GPT-2's ByteLevel regex gives `gpt-2`, Qwen2's Split regex gives
`qwen2`; anything else needs `--pre NAME`. `mtp synth` writes a GPT-2-style tokenizer.

Bad input stops with `error: FILE: what is wrong` (exit 1), naming the key or tensor.
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("error: the `gguf` package is not importable: put LLAMA_CPP/gguf-py on PYTHONPATH")


class BadInput(Exception):
    pass


# Qwen2/Qwen3's pre-tokenizer regex as tokenizer.json spells it.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

DTYPES = {"BF16": (np.uint16, gguf.GGMLQuantizationType.BF16),
          "F16": (np.float16, gguf.GGMLQuantizationType.F16),
          "F32": (np.float32, gguf.GGMLQuantizationType.F32)}
FILE_TYPES = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "F32": gguf.LlamaFileType.ALL_F32}

T = gguf.MODEL_TENSOR
# HF name (after `model.`/`model.layers.N.`) -> llama.cpp tensor.
GLOBAL = {"model.embed_tokens.weight": T.TOKEN_EMBD, "model.norm.weight": T.OUTPUT_NORM,
          "lm_head.weight": T.OUTPUT}
PER_LAYER = {"input_layernorm.weight": T.ATTN_NORM, "self_attn.q_proj.weight": T.ATTN_Q,
             "self_attn.k_proj.weight": T.ATTN_K, "self_attn.v_proj.weight": T.ATTN_V,
             "self_attn.o_proj.weight": T.ATTN_OUT, "self_attn.q_norm.weight": T.ATTN_Q_NORM,
             "self_attn.k_norm.weight": T.ATTN_K_NORM, "post_attention_layernorm.weight": T.FFN_NORM,
             "mlp.gate_proj.weight": T.FFN_GATE, "mlp.up_proj.weight": T.FFN_UP,
             "mlp.down_proj.weight": T.FFN_DOWN}
ARCHS = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}


def permute_heads(data, heads):
    """llama.cpp's converter's row order for llama's q/k: within each head, rows
    (half, i) -> (i, half)."""
    shape = data.shape
    return data.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_json(path, required=True):
    if not os.path.exists(path):
        if required:
            raise BadInput(f"{path}: not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: cannot read as JSON: {e}")
    if not isinstance(doc, dict):
        raise BadInput(f"{path}: not a JSON object")
    return doc


def key(cfg, path, name, kind=int, default=None):
    """config[name] checked for type; a missing key without default is an error naming it."""
    v = cfg.get(name)
    if v is None:
        if default is None:
            raise BadInput(f"{path}: missing key `{name}`")
        return default
    if kind is float and type(v) is int:
        v = float(v)
    if type(v) is not kind:
        raise BadInput(f"{path}: `{name}` is {v!r}, expected {kind.__name__}")
    return v


def safetensors_tensors(path):
    """{name: (dtype, shape, ndarray view over a memory map)} of one safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadInput(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise BadInput(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{path}: header is not JSON: {e}")
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: tensor `{name}`: header entry lacks dtype, shape or data_offsets")
        if dtype not in DTYPES:
            raise BadInput(f"{path}: tensor `{name}` is {dtype}; only BF16, F16 and F32 are converted")
        np_dtype = DTYPES[dtype][0]
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if not (0 <= start <= end <= len(data)) or end - start != want:
            raise BadInput(f"{path}: tensor `{name}`: data_offsets {start}..{end} do not hold "
                           f"{shape} {dtype} ({want} bytes) within {len(data)} bytes of data")
        out[name] = (dtype, shape, data[start:end].view(np_dtype).reshape(shape))
    return out


def load_weights(ckpt):
    single = os.path.join(ckpt, "model.safetensors")
    if os.path.exists(single):
        return safetensors_tensors(single)
    index_path = os.path.join(ckpt, "model.safetensors.index.json")
    index = read_json(index_path, required=False)
    if index is None:
        raise BadInput(f"{ckpt}: neither model.safetensors nor model.safetensors.index.json")
    if not isinstance(index.get("weight_map"), dict):
        raise BadInput(f"{index_path}: missing key `weight_map`")
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(safetensors_tensors(os.path.join(ckpt, shard)))
    return out


def hyperparameters(ckpt):
    path = os.path.join(ckpt, "config.json")
    cfg = read_json(path)
    if cfg.get("model_type") not in ARCHS:
        raise BadInput(f"{path}: `model_type` is {cfg.get('model_type')!r}; this converter writes "
                       "qwen3, qwen2 and llama only")
    hidden = key(cfg, path, "hidden_size")
    heads = key(cfg, path, "num_attention_heads")
    hp = {
        "model_type": cfg["model_type"],
        "vocab": key(cfg, path, "vocab_size"),
        "hidden": hidden,
        "layers": key(cfg, path, "num_hidden_layers"),
        "ffn": key(cfg, path, "intermediate_size"),
        "heads": heads,
        "kv_heads": key(cfg, path, "num_key_value_heads", default=heads),
        "head_dim": key(cfg, path, "head_dim", default=hidden // heads),
        "context": key(cfg, path, "max_position_embeddings"),
        "eps": key(cfg, path, "rms_norm_eps", float),
        "tied": key(cfg, path, "tie_word_embeddings", bool, default=False),
    }
    # transformers 4 writes rope_theta at the top level, transformers 5 inside rope_parameters.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise BadInput(f"{path}: `rope_parameters` is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise BadInput(f"{path}: rope type {kind!r}: only unscaled RoPE is converted")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise BadInput(f"{path}: missing key `rope_theta` (top level or in `rope_parameters`)")
    hp["theta"] = float(theta)

    def ids(v, name, src):
        v = v if isinstance(v, list) else [v]
        if not v or not all(isinstance(i, int) and 0 <= i < hp["vocab"] for i in v):
            raise BadInput(f"{src}: `{name}` {v!r} is not a token id below vocab_size {hp['vocab']}")
        return v

    gen_path = os.path.join(ckpt, "generation_config.json")
    gen = read_json(gen_path, required=False) or {}
    for name in ("bos_token_id", "eos_token_id"):
        src, v = (gen_path, gen[name]) if gen.get(name) is not None else (path, cfg.get(name))
        hp[name] = ids(v, name, src)[0] if v is not None else None
    return hp


def tokenizer(ckpt, hp, pre):
    path = os.path.join(ckpt, "tokenizer.json")
    tok = read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise BadInput(f"{path}: `model.type` is {model.get('type')!r}; only byte-level BPE is converted")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise BadInput(f"{path}: `model.vocab` (object) or `model.merges` (list) missing")
    by_id = {}
    for text, i in vocab.items():
        if type(i) is not int or i < 0:
            raise BadInput(f"{path}: `model.vocab` gives {text!r} the id {i!r}")
        by_id[i] = text
    added = {}
    for a in tok.get("added_tokens") or []:
        if not isinstance(a, dict) or type(a.get("id")) is not int or not isinstance(a.get("content"), str):
            raise BadInput(f"{path}: an entry of `added_tokens` lacks an integer `id` or a `content`")
        by_id[a["id"]] = a["content"]
        added[a["id"]] = bool(a.get("special"))
    if by_id and max(by_id) >= hp["vocab"]:
        raise BadInput(f"{path}: token id {max(by_id)} is at or past config.json's vocab_size {hp['vocab']}")
    tokens, types = [], []
    for i in range(hp["vocab"]):
        if i not in by_id:  # a vocab_size padded past the tokenizer (Qwen: 151,936 rows)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i] else gguf.TokenType.USER_DEFINED)
    merge_lines = []
    for m in merges:
        if isinstance(m, list) and len(m) == 2:
            merge_lines.append(f"{m[0]} {m[1]}")
        elif isinstance(m, str) and " " in m:
            merge_lines.append(m)
        else:
            raise BadInput(f"{path}: merge {m!r} is neither \"a b\" nor [\"a\", \"b\"]")

    if pre is None:
        p = tok.get("pre_tokenizer") or {}
        parts = p.get("pretokenizers", [p]) if p.get("type") == "Sequence" else [p]
        split = [x for x in parts if x.get("type") == "Split"]
        if len(parts) == 1 and parts[0].get("type") == "ByteLevel" and parts[0].get("use_regex", True):
            pre = "gpt-2"
        elif len(split) == 1 and (split[0].get("pattern") or {}).get("Regex") == QWEN2_REGEX:
            pre = "qwen2"
        else:
            raise BadInput(f"{path}: `pre_tokenizer` is neither GPT-2's ByteLevel regex nor Qwen2's Split; "
                           "pass --pre NAME (a llama.cpp pre-tokenizer name)")
    # BOS is added only where the post-processor's template starts with it (Qwen's: none).
    post = tok.get("post_processor") or {}
    first = (post.get("single") or [{}])[0] if post.get("type") == "TemplateProcessing" else {}
    bos = hp["bos_token_id"]
    add_bos = bos is not None and (first.get("SpecialToken") or {}).get("id") == tokens[bos]
    return tokens, types, merge_lines, pre, add_bos


def chat_template(ckpt, file):
    if file is None:
        jinja = os.path.join(ckpt, "chat_template.jinja")
        if not os.path.exists(jinja):
            t = (read_json(os.path.join(ckpt, "tokenizer_config.json"), required=False) or {}).get("chat_template")
            return t if isinstance(t, str) else None
        file = jinja
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{file}: cannot read: {e}")


def convert(ckpt, out, pre, template_file=None):
    hp = hyperparameters(ckpt)
    tokens, types, merges, pre, add_bos = tokenizer(ckpt, hp, pre)
    weights = load_weights(ckpt)
    arch = ARCHS[hp["model_type"]]
    allowed = set(gguf.MODEL_TENSORS[arch])
    name_map = gguf.get_tensor_name_map(arch, hp["layers"])
    head, kvd, h, ffn = hp["heads"] * hp["head_dim"], hp["kv_heads"] * hp["head_dim"], hp["hidden"], hp["ffn"]
    shapes = {T.TOKEN_EMBD: [hp["vocab"], h], T.OUTPUT: [hp["vocab"], h], T.OUTPUT_NORM: [h],
              T.ATTN_NORM: [h], T.FFN_NORM: [h], T.ATTN_Q: [head, h], T.ATTN_K: [kvd, h],
              T.ATTN_V: [kvd, h], T.ATTN_OUT: [h, head], T.ATTN_Q_NORM: [hp["head_dim"]],
              T.ATTN_K_NORM: [hp["head_dim"]], T.FFN_GATE: [ffn, h], T.FFN_UP: [ffn, h], T.FFN_DOWN: [h, ffn]}
    safetensors_name = "model.safetensors" if os.path.exists(os.path.join(ckpt, "model.safetensors")) \
        else "model.safetensors.index.json"

    wanted = dict(GLOBAL)
    per_layer = dict(PER_LAYER)
    if hp["model_type"] != "qwen3":
        del per_layer["self_attn.q_norm.weight"], per_layer["self_attn.k_norm.weight"]
    if hp["model_type"] == "qwen2":
        per_layer.update({f"self_attn.{p}_proj.bias": t for p, t in (("q", T.ATTN_Q), ("k", T.ATTN_K),
                                                                     ("v", T.ATTN_V))})
    for b in range(hp["layers"]):
        wanted.update({f"model.layers.{b}.{k}": v for k, v in per_layer.items()})
    if hp["tied"]:
        wanted.pop("lm_head.weight")
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise BadInput(f"{ckpt}/{safetensors_name}: missing tensors {', '.join(missing[:5])}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    skipped = []
    for name in weights:
        if name in wanted:
            continue
        if "mtp_layers." in name or (hp["tied"] and name == "lm_head.weight"):
            skipped.append(name)
        else:
            raise BadInput(f"{ckpt}/{safetensors_name}: tensor `{name}` is not part of a {hp['model_type']} model")
    if skipped:
        print(f"note: left out {len(skipped)} tensors llama.cpp's {hp['model_type']} does not read "
              f"(e.g. {skipped[0]})", file=sys.stderr)

    matrix_dtype = weights["model.embed_tokens.weight"][0]
    tmp = out + ".partial"
    w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(os.path.basename(os.path.normpath(ckpt)))
    w.add_file_type(FILE_TYPES[matrix_dtype])
    w.add_context_length(hp["context"])
    w.add_embedding_length(hp["hidden"])
    w.add_block_count(hp["layers"])
    w.add_feed_forward_length(hp["ffn"])
    w.add_head_count(hp["heads"])
    w.add_head_count_kv(hp["kv_heads"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_rope_freq_base(hp["theta"])
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if hp["bos_token_id"] is not None:
        w.add_bos_token_id(hp["bos_token_id"])
    if hp["eos_token_id"] is not None:
        w.add_eos_token_id(hp["eos_token_id"])
    w.add_add_bos_token(add_bos)
    template = chat_template(ckpt, template_file)
    if template:
        w.add_chat_template(template)

    for name, kind in wanted.items():
        if kind not in allowed:
            raise BadInput(f"gguf-py: {kind.name} is not a tensor of arch {hp['model_type']} in this llama.cpp tree")
        bid = None
        if name.startswith("model.layers."):
            bid = int(name.split(".")[2])
        suffix = ".bias" if name.endswith(".bias") else ".weight"
        gguf_name = gguf.TENSOR_NAMES[kind].format(bid=bid)
        mapped = name_map.get_name(name, try_suffixes=(suffix,))
        if mapped != gguf_name + suffix:
            raise BadInput(f"gguf-py: tensor map sends `{name}` to {mapped!r}, expected {gguf_name}{suffix}")
        dtype, shape, data = weights[name]
        if suffix == ".bias":
            want = shapes[kind][:1]
        else:
            want = shapes[kind]
        if hp["model_type"] == "llama" and kind in (T.ATTN_Q, T.ATTN_K):
            data = permute_heads(np.asarray(data), hp["heads"] if kind == T.ATTN_Q else hp["kv_heads"])
        if shape != want:
            raise BadInput(f"{ckpt}/{safetensors_name}: tensor `{name}` has shape {shape}, "
                           f"config.json implies {want}")
        if len(shape) == 1:  # norms go in as f32
            data = (data.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else data.astype(np.float32)
            w.add_tensor(gguf_name + suffix, data)
        else:
            w.add_tensor(gguf_name + suffix, data, raw_dtype=DTYPES[dtype][1])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, out)
    print(f"wrote {out}: {hp['model_type']}, {hp['layers']} layers, {len(wanted)} tensors ({matrix_dtype} matrices), "
          f"{len(tokens)} tokens, pre-tokenizer {pre}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="Hugging Face checkpoint directory (Qwen3, Qwen2 or Llama)")
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--pre", help="llama.cpp pre-tokenizer name (default: read off tokenizer.json)")
    ap.add_argument("--chat-template", help="a Jinja chat template file (default: the checkpoint's own)")
    args = ap.parse_args()
    try:
        convert(args.checkpoint, args.out, args.pre, args.chat_template)
    except BadInput as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
