"""Step 1 of the recipe (CPU, a few minutes): corpus -> tokenizer -> token files.

    python3 prepare.py --repo .. --out data

Writes into --out:
  tokenizer.json           byte-level BPE (VOCAB ids; 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>)
  train.u16.xz, val.u16.xz little-endian uint16 token ids, every document followed by id 0
  heldout.u16.xz           the repository's own *.rs files, tokenized the same way (never trained on)
  corpus.txt               the selected files (crate-version/path), one per line, with a digest
  heldout-prompts.jsonl    benchmark prompts cut from the held-out files (see cut_prompts)
"""
import argparse
import hashlib
import json
import lzma
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import corpus

VOCAB = 8192
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VAL_EVERY = 100  # every 100th selected document is validation, not training
PROMPTS = 16
PROMPT_MIN_CHARS = 240
# The commit whose *.rs files are the held-out set (the family was trained against it).
HELDOUT_COMMIT = "6dc74e151b7d5b3f3a2d6da3c4c97f5d1eb0cc51"


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def tokenize(tok, texts):
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, dtype="<u2")


def write_tokens(path, arr):
    with lzma.open(path, "wb", preset=6) as f:
        f.write(arr.tobytes())


def cut_prompts(sources):
    """PROMPTS prompts from the held-out files: files of at least 2 KB (fixtures left
    out) in path order, PROMPTS of them evenly spaced; from each, whole lines starting at
    the first line past the middle of the file, until PROMPT_MIN_CHARS characters."""
    files = [(p, t) for p, t in sources if len(t) >= 2048 and not p.startswith("tests/fixtures")]
    picks = [files[i * (len(files) - 1) // (PROMPTS - 1)] for i in range(PROMPTS)]
    out = []
    for path, text in picks:
        start = text.index("\n", len(text) // 2) + 1
        end = start
        while end - start < PROMPT_MIN_CHARS:
            end = text.index("\n", end) + 1
        out.append({"id": path, "prompt": text[start:end]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default="..", help="the repository whose *.rs files are held out")
    ap.add_argument("--heldout-commit", default=HELDOUT_COMMIT, help="the commit they are read at")
    ap.add_argument("--out", default="data")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    docs = corpus.select_corpus()
    train = [t for i, (_, t) in enumerate(docs) if i % VAL_EVERY != 0]
    val = [t for i, (_, t) in enumerate(docs) if i % VAL_EVERY == 0]
    digest = hashlib.sha256("".join(p + "\0" + t for p, t in docs).encode()).hexdigest()
    with open(os.path.join(args.out, "corpus.txt"), "w") as f:
        f.write(f"# {len(docs)} files, {sum(len(t.encode()) for _, t in docs)} bytes, sha256 {digest}\n")
        f.writelines(p + "\n" for p, _ in docs)

    tok = train_tokenizer(train)
    assert [tok.token_to_id(s) for s in SPECIAL] == [0, 1, 2]
    tok.save(os.path.join(args.out, "tokenizer.json"))

    held = corpus.project_sources(os.path.abspath(args.repo), args.heldout_commit)
    stats = {"heldout_commit": args.heldout_commit, "vocab": tok.get_vocab_size(), "files": len(docs), "bytes": sum(len(t.encode()) for _, t in docs), "sha256": digest}
    for name, texts in [("train", train), ("val", val), ("heldout", [t for _, t in held])]:
        arr = tokenize(tok, texts)
        write_tokens(os.path.join(args.out, f"{name}.u16.xz"), arr)
        stats[name] = {"docs": len(texts), "tokens": int(arr.size), "bytes": sum(len(t.encode()) for t in texts)}
    with open(os.path.join(args.out, "heldout-prompts.jsonl"), "w") as f:
        for p in cut_prompts(held):
            f.write(json.dumps(p) + "\n")
    with open(os.path.join(args.out, "prepare.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
