#!/usr/bin/env python3
"""Drives `mtp serve`'s `/v1/messages` with the official `anthropic` client: `messages.create`
for text and tool use (`tool_choice` any and tool), `messages.stream(...)` with
`get_final_message()` (checked against the text the stream's events carried), and
`messages.count_tokens`. Requests run concurrently, staggered. Prints one JSON line per
request: the request, the message the client assembled (or the count), for
tests/server_messages.rs to compare with the same request sent alone.

The SDK's typed parameters have no `temperature` or `seed`: they go in `extra_body`, as a
client of any server with extensions sends them.

    python scripts/anthropic_client_check.py --base-url http://127.0.0.1:8000 --model mtp-trained
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic

TOOLS = [
    {"name": "get_weather", "description": "The weather in a city",
     "input_schema": {"type": "object",
                      "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city"], "additionalProperties": False}},
    {"name": "get_time",
     "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                      "required": ["zone"], "additionalProperties": False}},
]


def cases():
    out = []
    for i in range(8):
        body = {
            "messages": [{"role": "user", "content": f"case {i}: the weather in Lima?"}],
            "max_tokens": 64,
            "system": "You call tools.",
            "metadata": {"user_id": f"user-{i}"},
        }
        sampling = {"temperature": 0.0 if i % 4 < 2 else 0.8, "seed": 300 + i}
        if i < 2:
            name = "text"
        elif i < 4:
            name = "tool-any"
            body.update(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
        elif i < 6:
            name = "tool-named"
            body.update(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
        else:
            name = "stop-sequences"
            body["stop_sequences"] = ["\n"]
        out.append({"name": f"{name}-{i}", "body": body, "sampling": sampling, "stream": i % 2 == 1})
    return out


def streamed(client, model, case):
    """A message through the SDK's streaming helper: its final message, after checking
    that the text it holds is what the stream's text events carried."""
    text = ""
    with client.messages.stream(model=model, **case["body"], extra_body=case["sampling"]) as stream:
        for piece in stream.text_stream:
            text += piece
        final = stream.get_final_message()
    held = "".join(b.text for b in final.content if b.type == "text")
    if held != text:
        raise SystemExit(f"{case['name']}: the final message holds {held!r}, the stream sent {text!r}")
    return final


def run(client, model, case, delay):
    time.sleep(delay)
    if case["stream"]:
        message = streamed(client, model, case)
    else:
        message = client.messages.create(model=model, **case["body"], extra_body=case["sampling"])
    request = dict(case["body"], **case["sampling"])
    return {"name": case["name"], "request": request, "streamed": case["stream"],
            "message": message.model_dump(mode="json", exclude_none=True)}


def count(client, model, case):
    body = {k: v for k, v in case["body"].items() if k in ("messages", "system", "tools", "tool_choice")}
    n = client.messages.count_tokens(model=model, **body).input_tokens
    return {"name": f"count-{case['name']}", "request": body, "input_tokens": n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    todo = cases()
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        futures = [pool.submit(run, client, args.model, c, 0.03 * i) for i, c in enumerate(todo)]
        for f in futures:
            print(json.dumps(f.result()))
    for c in todo[1:4]:
        print(json.dumps(count(client, args.model, c)))


if __name__ == "__main__":
    main()
