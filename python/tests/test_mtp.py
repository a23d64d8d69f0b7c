"""The Python package against the engine's guarantees, through the binding: batched equals
alone and speculative equals plain, bit for bit (tokens and logprobs as f32 bits), streams
equal `generate`, cancellation (closing a stream, Ctrl-C) leaves nothing running, bad input
raises `mtp.Error` with the CLI's words, the in-process chat and server answer as HTTP does,
and the README's Python example runs verbatim. Each exactness check has a negative control
showing it can fail. Runs on the small trained family the repository ships (CPU)."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import mtp

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests/fixtures/trained/target"
DRAFT = ROOT / "tests/fixtures/trained/draft"

PROMPTS = [
    "fn main() {",
    "struct Point {",
    "impl Iterator for Counter {",
    "use std::collections::HashMap;\n\nfn count(words: &[&str]) -> HashMap<&str, usize> {",
    "pub fn parse(s: &str) -> Result<u32, String> {",
    "#[derive(Debug, Clone)]\npub enum Token {",
]


def bits(out):
    """A result as exact bits: token ids and each logprob's f32 bit pattern."""
    return (out.token_ids, [struct.unpack("<I", struct.pack("<f", x))[0] for x in out.logprobs], out.finish_reason)


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if bits(x) != bits(y):
            return i
    return None


@pytest.fixture(scope="module")
def plain():
    return mtp.LLM(TARGET, drafter="none", max_batch=1)


def alone(llm, params):
    return [llm.generate(p, params)[0] for p in PROMPTS]


GREEDY = mtp.SamplingParams(max_tokens=20, ignore_eos=True)
SAMPLED = mtp.SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_and_speculative_equal_plain_alone(plain, params):
    want = alone(plain, params)
    drafters = [
        dict(drafter="auto"),
        dict(drafter="draft-model", draft=DRAFT, k=4),
        dict(drafter="ngram", k=3),
    ]
    for d in drafters:
        llm = mtp.LLM(TARGET, max_batch=4, **d)
        got = llm.generate(PROMPTS, params)
        assert first_difference(got, want) is None, f"{d}: prompt {first_difference(got, want)} differs"
        stats = llm.stats()
        # Not vacuous: the speculative path ran (drafts proposed, some accepted).
        assert stats["drafted"] > 0, (d, stats)
        if d["drafter"] != "ngram":
            assert stats["accepted"] > 0, (d, stats)
        # The per-request counts add up to the engine's, and to each output's tokens: the
        # prompt's forward gives the first token, each verify its accepted drafts plus one.
        for key in ("drafted", "accepted", "verifies"):
            assert sum(getattr(o.speculation, key) for o in got) == stats[key], (d, key)
        for o in got:
            s = o.speculation
            assert len(o.token_ids) <= 1 + s.verifies + s.accepted, (d, s)


def test_the_bits_comparison_can_fail(plain):
    """Negative controls: one ulp of one logprob, and another seed, are told apart."""
    want = alone(plain, SAMPLED)
    nudged = [mtp.RequestOutput(**vars(o)) for o in want]
    x = nudged[2].logprobs[5]
    nudged[2].logprobs = list(nudged[2].logprobs)
    nudged[2].logprobs[5] = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]
    assert first_difference(nudged, want) == 2
    other_seed = mtp.SamplingParams(**{**vars(SAMPLED), "seed": 8})
    assert first_difference(alone(plain, other_seed), want) is not None


def test_prompts_as_token_ids_and_per_prompt_params(plain):
    ids = plain.tokenizer.encode(PROMPTS[0])
    by_text = plain.generate(PROMPTS[0], GREEDY)[0]
    by_ids = plain.generate(ids, GREEDY)[0]
    assert bits(by_ids) == bits(by_text)
    assert by_text.outputs[0].text == by_text.text == plain.tokenizer.decode(by_text.token_ids)
    outs = plain.generate(PROMPTS[:2], [GREEDY, SAMPLED])
    assert bits(outs[1]) == bits(plain.generate(PROMPTS[1], SAMPLED)[0])
    tops = plain.generate(PROMPTS[0], mtp.SamplingParams(max_tokens=4, logprobs=3))[0]
    assert len(tops.top_logprobs) == 4 and all(len(t) == 3 for t in tops.top_logprobs)
    # The sampled token of a greedy request is the most likely one, logprob and all.
    assert [t[0] for t in tops.top_logprobs] == [(i, lp) for i, lp in zip(tops.token_ids, tops.logprobs)]


def test_stream_equals_generate(plain):
    llm = mtp.LLM(TARGET, max_batch=4)
    for params in (GREEDY, SAMPLED):
        want = plain.generate(PROMPTS[3], params)[0]
        deltas = list(llm.stream(PROMPTS[3], params))
        assert deltas[-1].finish_reason == want.finish_reason and deltas[-1].token_id is None
        tokens = [d.token_id for d in deltas[:-1]]
        logprobs = [d.logprob for d in deltas[:-1]]
        assert tokens == want.token_ids and struct.pack(f"<{len(logprobs)}f", *logprobs) == struct.pack(
            f"<{len(want.logprobs)}f", *want.logprobs
        )
        assert "".join(d.text for d in deltas) == want.text
        s = deltas[-1].speculation
        assert 0 < s.verifies and len(tokens) <= 1 + s.verifies + s.accepted, s


def test_interleaved_streams_are_batched_and_each_alone(plain):
    llm = mtp.LLM(TARGET, drafter="draft-model", draft=DRAFT, k=4, max_batch=4)
    streams = [llm.stream(p, SAMPLED) for p in PROMPTS[:4]]
    tokens = [[] for _ in streams]
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            d = next(streams[i])
            if d.finish_reason is not None:
                live.remove(i)
            else:
                tokens[i].append((d.token_id, struct.pack("<f", d.logprob)))
    for p, got in zip(PROMPTS, tokens):
        want = plain.generate(p, SAMPLED)[0]
        assert got == [(t, struct.pack("<f", lp)) for t, lp in zip(want.token_ids, want.logprobs)], p


def wait_idle(llm, seconds=10.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        s = llm.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.02)
    raise AssertionError(f"still running after {seconds} s: {llm.stats()}")


def test_closing_a_stream_cancels_its_request(plain):
    llm = mtp.LLM(TARGET, max_batch=2)
    long = mtp.SamplingParams(max_tokens=100_000, ignore_eos=True)
    it = llm.stream(PROMPTS[0], long)
    first = [next(it) for _ in range(3)]
    assert all(d.token_id is not None for d in first)
    it.close()
    s = wait_idle(llm)
    assert s["generated_tokens"] < 100_000
    # The engine goes on serving, with the same bits.
    assert bits(llm.generate(PROMPTS[1], GREEDY)[0]) == bits(plain.generate(PROMPTS[1], GREEDY)[0])


def test_ctrl_c_interrupts_generate_and_cancels_its_requests(plain):
    llm = mtp.LLM(TARGET, max_batch=4)
    long = mtp.SamplingParams(max_tokens=100_000, ignore_eos=True)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        started = time.time()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, long)
        assert time.time() - started < 5, "Ctrl-C took effect late"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wait_idle(llm)
    assert bits(llm.generate(PROMPTS[2], GREEDY)[0]) == bits(plain.generate(PROMPTS[2], GREEDY)[0])


def test_bad_input_raises_with_the_clis_words(plain):
    cases = [
        (lambda: plain.generate("x", mtp.SamplingParams(temperature=-1.0)), "temperature must be a finite number"),
        (lambda: plain.generate("x", mtp.SamplingParams(top_p=2.0)), "top_p"),
        (lambda: plain.generate(["x", "y"], mtp.SamplingParams(json_schema={"type": 3})), "prompts[0]"),
        (lambda: plain.generate("x", mtp.SamplingParams(regex="a", grammar="start: \"a\"")), "at most one"),
        (lambda: plain.generate(["x", [1, 10**9]]), "request prompts[1]: prompt token id 1000000000 is outside"),
        (lambda: mtp.LLM(TARGET, drafter="eagle"), "unknown --drafter `eagle`"),
        (lambda: mtp.LLM(TARGET, drafter="draft-model"), "--drafter draft-model needs --draft"),
        (lambda: mtp.LLM("/nonexistent/checkpoint"), "/nonexistent/checkpoint"),
        (lambda: mtp.LLM(TARGET, max_batch=0), "max_batch=0: must be at least 1"),
        (lambda: mtp.LLM(TARGET, k=0), "k=0"),
        (lambda: mtp.LLM(TARGET, backend="tpu"), "tpu"),
        (lambda: plain.chat([]), "messages"),
    ]
    for i, (call, words) in enumerate(cases):
        with pytest.raises(mtp.Error) as e:
            call()
        assert words in str(e.value), f"case {i}: {e.value}"
    for bad in ([], [1.5], [["a"]], 3):
        with pytest.raises((TypeError, ValueError)):
            plain.generate(bad)
    # Nothing was left behind, and the engine still answers.
    wait_idle(plain)
    assert plain.generate(PROMPTS[0], GREEDY)[0].finish_reason == "length"


def test_a_json_schema_constrains_the_output(plain):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = plain.generate("let v = ", mtp.SamplingParams(max_tokens=64, json_schema=schema))[0]
    assert out.finish_reason == "grammar", out
    assert isinstance(json.loads(out.text)["n"], int)


def test_chat_and_the_server_answer_as_http_does(plain):
    llm = mtp.LLM(TARGET, drafter="auto", max_batch=4)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    params = mtp.SamplingParams(max_tokens=24)
    chat = llm.chat(messages, params)
    assert chat.finish_reason in ("length", "stop") and chat.text
    with llm.serve(port=0) as server:
        assert urllib.request.urlopen(server.url + "/health").status == 200
        body = {"model": llm.model_name, "messages": messages, "max_tokens": 24, "temperature": 0.0, "seed": 0}
        req = urllib.request.Request(
            server.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        http = json.loads(urllib.request.urlopen(req).read())
        assert http["choices"][0]["message"]["content"] == chat.text
        body = {"model": llm.model_name, "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0}
        req = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        http = json.loads(urllib.request.urlopen(req).read())
        assert http["choices"][0]["text"] == plain.generate(PROMPTS[1], mtp.SamplingParams(max_tokens=20))[0].text


def readme_python_example():
    """The README's Python quick start: the ```python block after its `pip install ./python`."""
    text = (ROOT / "README.md").read_text()
    at = text.index("pip install ./python")
    start = text.index("```python\n", at) + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_readme_example_runs_verbatim():
    code = readme_python_example()
    assert "mtp.LLM" in code
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "the example printed nothing"
