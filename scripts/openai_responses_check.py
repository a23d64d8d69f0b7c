#!/usr/bin/env python3
"""Drives `mtp serve`'s `/v1/responses` with the official `openai` client: `responses.create`
(text, instructions with a list of message items, function calls required and named, a
function_call / function_call_output round trip with the SDK's own output items sent back),
`stream=True` events reassembled by hand, the SDK's `responses.stream(...)` helper with
`get_final_response()` equal to the same request unstreamed, and `responses.parse` into a
pydantic model (unstreamed and through the stream helper). With `openai-agents` importable, a
tiny agent run on its default (Responses) model path, a tool called and its result answered.
Requests run concurrently, staggered. Prints one JSON line per request: the body the client
sent (captured off the wire, `stream` left out) and the reply it read (status, text, calls,
output tokens), for tests/server_responses.rs to compare with the same body sent alone.
Anything the client itself sees wrong exits non-zero.

    python scripts/openai_responses_check.py --base-url http://127.0.0.1:8000/v1 --model mtp-trained
"""

import argparse
import json
import typing
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
     "parameters": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8},
                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                    "required": ["city"], "additionalProperties": False}},
    {"type": "function", "name": "get_time", "strict": True,
     "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                    "required": ["zone"], "additionalProperties": False}},
]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=7)


def fail(name, message):
    raise SystemExit(f"{name}: {message}")


class Recorder:
    """A client whose last request body is kept (the SDK's own serialization)."""

    def __init__(self, base_url):
        self.body = None
        hooks = {"request": [self.keep]}
        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300,
                                    http_client=openai.DefaultHttpxClient(event_hooks=hooks))

    def keep(self, request):
        if request.url.path.endswith("/responses"):
            self.body = json.loads(request.content)


def summary(resp):
    """What a Response came to, read through the SDK's typed model."""
    text = "".join(p.text for item in resp.output if item.type == "message" for p in item.content
                   if p.type == "output_text")
    if text != resp.output_text:
        fail(resp.id, f"output_text {resp.output_text!r} is not the message text {text!r}")
    calls = [[i.name, i.arguments] for i in resp.output if i.type == "function_call"]
    for i in resp.output:
        if i.type == "function_call" and not (i.call_id and i.id):
            fail(resp.id, f"a function_call without call_id or id: {i}")
    return {"status": resp.status, "text": text, "calls": calls, "output_tokens": resp.usage.output_tokens}


def shape(resp):
    """A Response's output as JSON, less its ids (they differ between requests) and what
    the SDK's helpers parsed (compared on their own)."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ("id", "call_id", "parsed", "parsed_arguments")}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip([i.model_dump(exclude_none=True) for i in resp.output]), resp.status, resp.usage.output_tokens


def by_hand(rec, model, name, body):
    """`stream=True`: the raw events, checked and reassembled; the last one's response
    must be what the deltas built, and the same request unstreamed."""
    events = list(rec.client.responses.create(model=model, stream=True, **body))
    sent = rec.body
    seqs = [e.sequence_number for e in events]
    if seqs != list(range(len(events))):
        fail(name, f"sequence numbers {seqs}")
    kinds = [e.type for e in events]
    if kinds[:2] != ["response.created", "response.in_progress"]:
        fail(name, f"the stream starts {kinds[:2]}")
    if kinds[-1] not in ("response.completed", "response.incomplete"):
        fail(name, f"the stream ends {kinds[-1]}")
    texts = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            texts[e.output_index] = texts.get(e.output_index, "") + e.delta
    final = events[-1].response
    for k, item in enumerate(final.output):
        whole = item.arguments if item.type == "function_call" else "".join(p.text for p in item.content)
        if texts.get(k, "") != whole:
            fail(name, f"item {k}: the deltas make {texts.get(k, '')!r}, the response says {whole!r}")
    whole = rec.client.responses.create(model=model, **body)
    if shape(whole) != shape(final):
        fail(name, f"streamed {shape(final)} but unstreamed {shape(whole)}")
    return sent, summary(final)


def helper(rec, model, name, body, text_format=None):
    """The SDK's `responses.stream(...)`: its final response must equal the same request
    unstreamed (and its parse, when a text format is given)."""
    extra = {"text_format": text_format} if text_format else {}
    deltas = ""
    with rec.client.responses.stream(model=model, **body, **extra) as stream:
        for event in stream:
            if event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                deltas += event.delta
        final = stream.get_final_response()
    sent = rec.body
    if text_format:
        whole = rec.client.responses.parse(model=model, **body, **extra)
        if final.output_parsed != whole.output_parsed or not isinstance(final.output_parsed, text_format):
            fail(name, f"parsed {final.output_parsed!r} streamed, {whole.output_parsed!r} whole")
    else:
        whole = rec.client.responses.create(model=model, **body)
    if shape(whole) != shape(final):
        fail(name, f"the stream helper gave {shape(final)}, unstreamed {shape(whole)}")
    joined = final.output_text + "".join(i.arguments for i in final.output if i.type == "function_call")
    if deltas != joined:
        fail(name, f"the helper's deltas {deltas!r} are not the final response's {joined!r}")
    return sent, summary(final)


def round_trip(rec, model, name, body):
    """A call, then its output sent back with the SDK's own output items as input."""
    first = rec.client.responses.create(model=model, **body)
    calls = [i for i in first.output if i.type == "function_call"]
    if len(calls) != 1:
        fail(name, f"expected one call, got {first.output}")
    follow = {"input": [*body["input"], *first.output,
                        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "{\"temp_c\": 4}"}],
              "tools": TOOLS, "max_output_tokens": 16, "temperature": 0}
    resp = rec.client.responses.create(model=model, **follow)
    return rec.body, summary(resp)


def cases():
    user = lambda i, what: f"case {i}: {what}"  # noqa: E731
    weather = {"type": "json_schema", "name": "weather", "strict": True, "schema": TOOLS[0]["parameters"]}
    return [
        ("text", "create", {"input": user(0, "write a function that adds numbers"), "max_output_tokens": 24,
                            "temperature": 0}),
        ("text-items-seeded", "create", {
            "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.8,
            "extra_body": {"seed": 9},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": user(1, "sort a list")}]}]}),
        ("call-required", "create", {"input": user(2, "the weather in Lima?"), "tools": TOOLS,
                                     "tool_choice": "required", "parallel_tool_calls": False,
                                     "max_output_tokens": 96, "temperature": 0}),
        ("call-named", "create", {"input": user(3, "the time?"), "tools": TOOLS,
                                  "tool_choice": {"type": "function", "name": "get_time"},
                                  "max_output_tokens": 64, "temperature": 0}),
        ("json-schema", "create", {"input": user(4, "weather as JSON"), "text": {"format": weather},
                                   "max_output_tokens": 64, "temperature": 0}),
        ("stream-text", "by_hand", {"input": user(5, "a haiku"), "max_output_tokens": 20, "temperature": 0}),
        ("stream-call", "by_hand", {"input": user(6, "the weather in Oslo?"), "tools": TOOLS,
                                    "tool_choice": "required", "parallel_tool_calls": False,
                                    "max_output_tokens": 96, "temperature": 0.7, "extra_body": {"seed": 4}}),
        ("helper-call", "helper", {"input": user(7, "the weather in Rome?"), "tools": TOOLS,
                                   "tool_choice": "required", "parallel_tool_calls": False,
                                   "max_output_tokens": 96, "temperature": 0}),
        ("helper-parse", "helper_parse", {"input": user(8, "weather in Rome as JSON"), "max_output_tokens": 64,
                                          "temperature": 0}),
        ("round-trip", "round_trip", {"input": [{"role": "user", "content": user(9, "the weather in Oslo?")}],
                                      "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                                      "max_output_tokens": 96, "temperature": 0}),
    ]


def run(base_url, model, case, delay):
    time.sleep(delay)
    name, how, body = case
    rec = Recorder(base_url)
    if how == "create":
        resp = rec.client.responses.create(model=model, **body)
        sent, reply = rec.body, summary(resp)
    elif how == "by_hand":
        sent, reply = by_hand(rec, model, name, body)
    elif how == "helper":
        sent, reply = helper(rec, model, name, body)
    elif how == "helper_parse":
        sent, reply = helper(rec, model, name, body, text_format=Weather)
        # `parse` through the SDK's schema: the document is a Weather.
        Weather.model_validate_json(reply["text"])
    else:
        sent, reply = round_trip(rec, model, name, body)
    sent.pop("stream", None)
    return {"name": name, "request": sent, "reply": reply}


class TimeAnswer(pydantic.BaseModel):
    zone: str = pydantic.Field(max_length=4)
    time: str = pydantic.Field(max_length=8)


def agent_run(base_url, model):
    """Tiny runs of the Agents SDK on its default (Responses) model path: an agent calls
    its tool (tool_choice required) and stops on its result; then a second agent, given
    that run's items (the call and its output, as the SDK sends them back), answers in a
    structured `output_type` (a json_schema text format: the tiny model's free text would
    run to its length, which the SDK takes as a failure; and a format cannot constrain a
    reply that may be calls, so the second agent has no tools)."""
    import agents

    calls = []

    @agents.function_tool
    def get_time(zone: typing.Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        calls.append(zone)
        return "14:05"

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agents.set_tracing_disabled(True)
    on = agents.OpenAIResponsesModel(model=model, openai_client=client)
    clock = agents.Agent(
        name="clock", instructions="Tell the time.", tools=[get_time], model=on,
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=48),
        tool_use_behavior="stop_on_first_tool")
    first = agents.Runner.run_sync(clock, "what time is it in utc?", max_turns=2)
    if len(calls) != 1 or first.final_output != "14:05":
        fail("agents", f"the tool calls {calls}, the run's output {first.final_output!r}")
    answer = agents.Agent(name="answer", instructions="Say the time.", model=on, output_type=TimeAnswer,
                          model_settings=agents.ModelSettings(temperature=0, max_tokens=48))
    second = agents.Runner.run_sync(answer, first.to_input_list(), max_turns=1)
    if not isinstance(second.final_output, TimeAnswer):
        fail("agents", f"the run ended with {second.final_output!r}")
    return {"name": "agents", "tool_calls": calls, "final_output": second.final_output.model_dump()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    todo = cases()
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        futures = [pool.submit(run, args.base_url, args.model, c, 0.03 * i) for i, c in enumerate(todo)]
        for f in futures:
            print(json.dumps(f.result()), flush=True)
    try:
        import agents  # noqa: F401
    except ImportError:
        return
    print(json.dumps(agent_run(args.base_url, args.model)))


if __name__ == "__main__":
    main()
