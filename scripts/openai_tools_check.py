#!/usr/bin/env python3
"""Drives `mtp serve` with the official `openai` client through tool calls (required, named,
streamed and not, greedy and seeded), `response_format: json_schema` and, with
`--reasoning`, replies whose reasoning is split into `reasoning_content`. Requests run
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
    for i in range(8):
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
        elif i < 6:
            name = "tools-named"
            body.update(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
        else:
            name = "response-format"
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "weather", "strict": True, "schema": TOOLS[0]["function"]["parameters"]}}
        out.append({"name": f"{name}-{i}{'-stream' if body['stream'] else ''}", "body": body})
    return out


def run(client, model, case, delay):
    time.sleep(delay)
    body = case["body"]
    resp = client.chat.completions.create(model=model, **body)
    content, reasoning, calls, finish = "", "", [], None
    for chunk in (resp if body["stream"] else [resp]):
        for c in chunk.choices:
            part = c.delta if body["stream"] else c.message
            content += part.content or ""
            # Not in the client's typed model: read from the extra fields.
            reasoning += (part.model_extra or {}).get("reasoning_content") or ""
            for t in part.tool_calls or []:
                index = getattr(t, "index", len(calls))
                if index == len(calls):
                    calls.append([t.function.name, ""])
                if t.function.name != calls[index][0] or not t.id or t.type != "function":
                    raise SystemExit(f"{case['name']}: a tool-call chunk without its id, type or name: {t}")
                calls[index][1] += t.function.arguments or ""
            finish = c.finish_reason or finish
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
