#!/usr/bin/env python3
"""A bounded load run against `mtp serve` with the official `openai` client: N streaming
requests from C concurrent clients (held-out Rust prompts, greedy and seeded sampling mixed).
Reports throughput, time to first token and inter-token latency (p50/p99), and checks that
nothing failed or was lost.

    cargo run --release -- serve --max-batch 16 &
    python scripts/serve_load.py --requests 500 --concurrency 64

`--shared-prefix T` instead measures time to first token one request at a time, every
prompt starting with the same T-token-ish block of code (run it against a server with
`--prefix-cache-mib 0` and one with the default to compare). `--burst-prefix T` runs the
concurrent load with every prompt starting with that block: agents sharing a system prompt.
`--api messages` sends the same load to `/v1/messages` with the official `anthropic`
client (each prompt as a user message; a token's arrival is a `content_block_delta`).
`--api responses` sends the requests to `/v1/responses` (streamed events; each final
`Response`'s text must be its deltas, concatenated) instead of `/v1/completions`.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import openai

HERE = os.path.dirname(os.path.abspath(__file__))


def prompts():
    path = os.path.join(HERE, "..", "examples", "heldout-prompts.jsonl")
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one_response(client, model, prompt, i, max_tokens):
    """A streamed `/v1/responses` request: its text deltas timed, its final `Response`
    checked against them (a mismatch raises, counted as an error)."""
    sampled = i % 2 == 1
    t0 = time.perf_counter()
    first, last, gaps, text, final = None, None, [], "", None
    stream = await client.responses.create(
        model=model, input=prompt, max_output_tokens=max_tokens, stream=True,
        temperature=0.8 if sampled else 0.0, extra_body={"seed": i},
    )
    async for event in stream:
        if event.type == "response.output_text.delta":
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    if final is None:
        raise RuntimeError("the stream ended without response.completed or response.incomplete")
    if final.output_text != text:
        raise RuntimeError(f"the final response says {final.output_text!r}, its deltas {text!r}")
    finish = "length" if final.status == "incomplete" else "stop"
    return {"ttft": first, "gaps": gaps, "tokens": final.usage.output_tokens, "finish": finish,
            "end": time.perf_counter()}


async def one(client, model, prompt, i, max_tokens, api="completions"):
    if api == "responses":
        return await one_response(client, model, prompt, i, max_tokens)
    if api == "messages":
        return await one_message(client, model, prompt, i, max_tokens)
    sampled = i % 2 == 1
    t0 = time.perf_counter()
    first, last, gaps, tokens, finish = None, None, [], 0, None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
        temperature=0.8 if sampled else 0.0, seed=i, extra_body={"return_token_ids": True},
    )
    async for chunk in stream:
        for c in chunk.choices:
            n = len((c.model_extra or {}).get("token_ids") or [])
            if n:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                tokens += n
            finish = c.finish_reason or finish
    return {"ttft": first, "gaps": gaps, "tokens": tokens, "finish": finish, "end": time.perf_counter()}


async def one_message(client, model, prompt, i, max_tokens):
    """`one` through Anthropic's Messages API: the stream's events, timed as they come."""
    sampled = i % 2 == 1
    t0 = time.perf_counter()
    first, last, gaps, tokens, finish = None, None, [], 0, None
    stream = await client.messages.create(
        model=model, max_tokens=max_tokens, stream=True, messages=[{"role": "user", "content": prompt}],
        extra_body={"temperature": 0.8 if sampled else 0.0, "seed": i},
    )
    async for event in stream:
        if event.type == "content_block_delta":
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
        elif event.type == "message_delta":
            tokens = event.usage.output_tokens
            # As the chat endpoint's finish reasons: every message that ends has one.
            finish = {"max_tokens": "length"}.get(event.delta.stop_reason, "stop") if event.delta.stop_reason else None
    return {"ttft": first, "gaps": gaps, "tokens": tokens, "finish": finish, "end": time.perf_counter()}


def with_prefix(tokens):
    texts = prompts()
    return "\n".join(texts)[: tokens * 4]  # about 4 characters per token of code


async def load(args, client, model):
    texts = prompts()
    if args.burst_prefix:
        prefix = with_prefix(args.burst_prefix)
        texts = [prefix + "\n" + t[:200] for t in texts]
    queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    results, errors = [], []

    async def worker():
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                results.append(await one(client, model, texts[i % len(texts)], i, args.max_tokens, args.api))
            except Exception as e:  # counted and reported: a load run must show every failure
                errors.append(f"request {i}: {e!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    lost = [r for r in results if r["finish"] not in ("stop", "length")]
    shared = f", a shared prefix of about {args.burst_prefix} tokens" if args.burst_prefix else ""
    print(f"requests {args.requests} to /v1/{args.api} from {args.concurrency} concurrent clients, "
          f"max_tokens {args.max_tokens}{shared}")
    print(f"completed {len(results)}, errors {len(errors)}, lost (no finish reason) {len(lost)}")
    print(f"wall {wall:.1f} s; {tokens} tokens; {tokens / wall:.1f} tokens/s; {len(results) / wall:.2f} requests/s")
    print(f"time to first token: p50 {pct(ttft, 50) * 1e3:.0f} ms, p90 {pct(ttft, 90) * 1e3:.0f} ms, "
          f"p99 {pct(ttft, 99) * 1e3:.0f} ms")
    print(f"inter-token latency: p50 {pct(gaps, 50) * 1e3:.1f} ms, p99 {pct(gaps, 99) * 1e3:.1f} ms")
    for e in errors[:10]:
        print(e, file=sys.stderr)
    return 0 if not errors and not lost and len(results) == args.requests else 1


async def shared_prefix(args, client, model):
    texts = prompts()
    prefix = with_prefix(args.shared_prefix)
    ttft = []
    for i in range(args.requests):
        r = await one(client, model, prefix + "\n" + texts[i % len(texts)][:200], i, 4, args.api)
        ttft.append(r["ttft"])
    warm = ttft[1:]
    print(f"shared prefix of about {args.shared_prefix} tokens, {args.requests} requests one at a time")
    print(f"first request {ttft[0] * 1e3:.0f} ms; later requests: p50 {pct(warm, 50) * 1e3:.0f} ms, "
          f"mean {statistics.mean(warm) * 1e3:.0f} ms")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--burst-prefix", type=int, default=0)
    ap.add_argument("--api", choices=["completions", "messages", "responses"], default="completions")
    args = ap.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600,
                                http_client=None)

    async def run():
        model = (await client.models.list()).data[0].id
        if args.api == "messages":
            import anthropic

            root = args.base_url.removesuffix("/").removesuffix("/v1")
            messages = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0, timeout=600)
            return await load(args, messages, model)
        if args.shared_prefix:
            return await shared_prefix(args, client, model)
        return await load(args, client, model)

    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
