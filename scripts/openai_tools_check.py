#!/usr/bin/env python3
"""Drives `mtp serve` with the official `openai` client through tool calls (required, named,
parallel, streamed and not, greedy and seeded), `response_format: json_schema` and, with
`--reasoning`, replies whose reasoning is split into `reasoning_content`. Streamed replies
go through the SDK's own assembling helper, `client.chat.completions.stream(...)`. Requests run
concurrently, staggered. Prints one JSON line per request: the request body and the reply
the client assembled (content, reasoning, calls, finish reason), for
tests/server_tools.rs to compare with the same request sent alone.

    python scripts/openai_tools_check.py --base-url http://127.0.0.1:8000/v1 --model mtp-trained
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 8},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]


def cases(reasoning):
    out = []
    for i in range(8 if reasoning else 10):
        body = {
            "messages": [{"role": "user", "content": f"case {i}: the weather in Lima?"}],
            "max_tokens": 96 if not reasoning else 20,
            "temperature": 0.0 if i % 4 < 2 else 0.8,
            "seed": 300 + i,
            "stream": i % 2 == 1,
        }
        if reasoning:
            name = "reasoning"
        elif i < 4:
            name = "tools-required"
            body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        elif i >= 8:
            name = "tools-parallel"
            body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
        elif i < 6:
            name = "tools-named"
            body.update(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
        else:
            name = "response-format"
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "weather", "strict": True, "schema": TOOLS[0]["function"]["parameters"]}}
        out.append({"name": f"{name}-{i}{'-stream' if body['stream'] else ''}", "body": body})
    return out


def streamed(client, model, case):
    """A streamed reply through the SDK's assembling helper, `chat.completions.stream`:
    its final completion's calls (id, name, arguments as the SDK concatenated them), after
    checking each raw chunk against OpenAI's format (a call's first chunk carries its id,
    type and name, later ones its index and arguments only)."""
    body = {k: v for k, v in case["body"].items() if k != "stream"}
    content, reasoning, heads = "", "", {}
    with client.chat.completions.stream(model=model, **body) as stream:
        for event in stream:
            if event.type != "chunk":
                continue
            for c in event.chunk.choices:
                content += c.delta.content or ""
                # Not in the client's typed model: read from the extra fields.
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                for t in c.delta.tool_calls or []:
                    if t.index not in heads:
                        if not t.id or t.type != "function" or not t.function.name:
                            raise SystemExit(f"{case['name']}: a call's first chunk without id, type or name: {t}")
                        heads[t.index] = (t.id, t.function.name)
                    elif t.id is not None or t.type is not None or t.function.name is not None:
                        raise SystemExit(f"{case['name']}: a later chunk repeats id, type or name: {t}")
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as e:
            final = e.completion
    choice = final.choices[0]
    calls = []
    for k, t in enumerate(choice.message.tool_calls or []):
        if (t.id, t.function.name) != heads.get(k):
            raise SystemExit(f"{case['name']}: the SDK assembled {t.id!r} {t.function.name!r}, sent {heads.get(k)}")
        calls.append([t.function.name, t.function.arguments])
    if (choice.message.content or "") != content:
        raise SystemExit(f"{case['name']}: the SDK assembled content {choice.message.content!r}, sent {content!r}")
    return content, reasoning, calls, choice.finish_reason


def run(client, model, case, delay):
    time.sleep(delay)
    body = case["body"]
    if body["stream"]:
        content, reasoning, calls, finish = streamed(client, model, case)
    else:
        resp = client.chat.completions.create(model=model, **body)
        message = resp.choices[0].message
        content = message.content or ""
        reasoning = (message.model_extra or {}).get("reasoning_content") or ""
        calls = [[t.function.name, t.function.arguments] for t in message.tool_calls or []]
        finish = resp.choices[0].finish_reason
    return {"name": case["name"], "request": body,
            "reply": {"content": content, "reasoning": reasoning, "calls": calls, "finish_reason": finish}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reasoning", action="store_true")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)
    todo = cases(args.reasoning)
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        futures = [pool.submit(run, client, args.model, c, 0.03 * i) for i, c in enumerate(todo)]
        for f in futures:
            print(json.dumps(f.result()))


if __name__ == "__main__":
    main()
