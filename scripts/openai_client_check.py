#!/usr/bin/env python3
"""Drives `mtp serve` with the official `openai` client: concurrent, staggered requests
(completions and chats, streamed and not, greedy and seeded sampling, stop strings).
Prints one JSON line per request with what came back (prompt and output token ids, logprobs,
text, finish reason) and what was asked, for tests/server.rs to compare bit for bit with the
same request run alone.

    python scripts/openai_client_check.py --base-url http://127.0.0.1:8000/v1 --model mtp-trained
"""

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai


def cases():
    out = []
    for i in range(12):
        chat = i % 2 == 1
        stream = i % 3 != 0
        temperature = 0.0 if i % 4 < 2 else 0.8
        out.append({
            "name": f"{'chat' if chat else 'completion'}-{i}{'-stream' if stream else ''}",
            "chat": chat,
            "stream": stream,
            "temperature": temperature,
            "seed": 500 + i,
            "stop": ["{\n", "\n//"] if i % 3 == 1 else [],
            "max_tokens": 8 + 3 * i,
            "text": f"// helper number {i}\nfn helper_{i}(" if not chat else f"write helper number {i}",
        })
    return out


def run(client, model, case, delay):
    time.sleep(delay)
    common = dict(
        model=model,
        max_tokens=case["max_tokens"],
        temperature=case["temperature"],
        seed=case["seed"],
        stop=case["stop"] or None,
        stream=case["stream"],
        extra_body={"return_token_ids": True},
    )
    if case["chat"]:
        resp = client.chat.completions.create(
            messages=[{"role": "user", "content": case["text"]}], logprobs=True, **common)
    else:
        resp = client.completions.create(prompt=case["text"], logprobs=0, **common)
    prompt_ids, ids, lps, text, finish = [], [], [], "", None
    chunks = resp if case["stream"] else [resp]
    for chunk in chunks:
        d = chunk.model_dump()
        prompt_ids = d.get("prompt_token_ids") or prompt_ids
        for c in d["choices"]:
            ids += c.get("token_ids") or []
            lp = c.get("logprobs")
            if case["chat"]:
                part = c["delta"]["content"] if case["stream"] else c["message"]["content"]
                lps += [x["logprob"] for x in (lp or {}).get("content") or []]
            else:
                part = c["text"]
                lps += (lp or {}).get("token_logprobs") or []
            text += part or ""
            finish = c.get("finish_reason") or finish
    return {
        "name": case["name"], "prompt_token_ids": prompt_ids, "token_ids": ids, "logprobs": lps,
        "text": text, "finish_reason": finish, "temperature": case["temperature"],
        "seed": case["seed"], "stop": case["stop"], "max_tokens": case["max_tokens"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)
    models = [m.id for m in client.models.list().data]
    if args.model not in models:
        sys.exit(f"/v1/models lists {models}, not {args.model}")
    # Bad input comes back as the client's own error type, with the status.
    try:
        client.completions.create(model=args.model, prompt="fn", max_tokens=2, temperature=-1)
        sys.exit("a negative temperature was accepted")
    except openai.BadRequestError:
        pass
    # lm-eval's scoring request through the client: a list of prompts, echo, logprobs,
    # max_tokens 0 (the numbers themselves are checked bit for bit in tests/server.rs).
    prompts = ["fn main() {", "struct Point {"]
    scored = client.completions.create(
        model=args.model, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    if [c.text for c in sorted(scored.choices, key=lambda c: c.index)] != prompts:
        sys.exit(f"echo with max_tokens 0 gave {[c.text for c in scored.choices]}")
    for c in scored.choices:
        lp = c.logprobs
        n = len(lp.tokens)
        if not (n > 1 and len(lp.token_logprobs) == n == len(lp.top_logprobs) == len(lp.text_offset)):
            sys.exit(f"echoed logprobs of uneven lengths: {lp}")
        if lp.token_logprobs[0] is not None or lp.top_logprobs[0] is not None:
            sys.exit(f"the first echoed token has a logprob: {lp}")
        if not all(x <= 0 for x in lp.token_logprobs[1:]) or not all(len(t) == 1 for t in lp.top_logprobs[1:]):
            sys.exit(f"echoed logprobs out of range: {lp}")
    todo = cases()
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        futures = [pool.submit(run, client, args.model, c, 0.05 * i) for i, c in enumerate(todo)]
        for f in futures:
            print(json.dumps(f.result()))


if __name__ == "__main__":
    main()
