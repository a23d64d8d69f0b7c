"""Lossless speculative generation with row-invariant numerics, from Python.

    import mtp
    llm = mtp.LLM()                      # the trained family shipped in the repository
    outs = llm.generate(["fn main() {", "struct Point {"], mtp.SamplingParams(max_tokens=32))
    print(outs[0].text)

Every output's tokens and logprobs are bitwise those of the same request decoded alone
with plain decoding, whatever the drafter, k, batch and arrival order (greedy and exact
sampling). The engine runs on a thread of its own with the GIL released; every wait here
is short, so Ctrl-C raises KeyboardInterrupt at once and cancels the requests it
interrupted. What the engine refuses is raised as `mtp.Error`, in the CLI's words.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _mtp
from ._mtp import Error

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "Speculation",
    "StreamDelta",
    "ChatOutput",
    "Tokenizer",
    "Server",
    "serve",
    "Error",
]

# Seconds one wait on the engine may take before Python gets to run (and see Ctrl-C).
_POLL_S = 0.05

Prompt = Union[str, Sequence[int]]


@dataclass
class SamplingParams:
    """How one request samples and when it stops (greedy by default).

    `seed` keys the random numbers with each token's position: the same seed gives the same
    output, alone or batched. `logprobs` asks for that many most likely alternatives per
    token (each output always carries its own tokens' logprobs). At most one of
    `json_schema`, `regex` and `grammar` (Lark) constrains the output."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    stop: Union[str, List[str], None] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    json_schema: Union[Dict[str, Any], str, None] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None

    def _line(self, prompt: Prompt, request_id: str) -> Dict[str, Any]:
        """The request as one prompts-JSONL object (parsed by the CLI's own reader)."""
        line: Dict[str, Any] = {"id": request_id}
        if isinstance(prompt, str):
            line["prompt"] = prompt
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("a prompt is a str or a list of token ids (int)")
            line["prompt_ids"] = ids
        line["max_tokens"] = self.max_tokens
        line["temperature"] = self.temperature
        line["top_p"] = self.top_p
        # vLLM writes -1 for "off"; here that is 0.
        line["top_k"] = 0 if self.top_k == -1 else self.top_k
        line["min_p"] = self.min_p
        line["seed"] = self.seed
        if self.stop is not None:
            line["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logprobs:
            line["top_logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            line["prompt_logprobs"] = self.prompt_logprobs
        if self.json_schema is not None:
            schema = self.json_schema
            line["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
        if self.regex is not None:
            line["regex"] = self.regex
        if self.grammar is not None:
            line["grammar"] = self.grammar
        return line


@dataclass
class Speculation:
    """What speculation did for one request: its target verifies after the prompt (one a
    round), the draft tokens they checked and those accepted."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target verify (plain decoding: 1)."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0


@dataclass
class RequestOutput:
    """One finished request. `logprobs[i]` is the natural-log probability of `token_ids[i]`
    under the target; `top_logprobs[i]` its alternatives `(token_id, logprob)`, most likely
    first, when asked; `prompt_logprobs` the prompt's tokens after the first as `(token_id,
    logprob, rank, alternatives)`, when asked. `finish_reason` is eos, length, stop or
    grammar. `speculation` says what the drafter did for this request."""

    request_id: str
    prompt: Prompt
    text: str
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    prompt_logprobs: Optional[List[Tuple[int, float, int, List[Tuple[int, float]]]]] = None
    speculation: Speculation = field(default_factory=Speculation)

    @property
    def outputs(self) -> List["RequestOutput"]:
        """`[self]`, for code written as `out.outputs[0].text` (one sequence per request)."""
        return [self]


@dataclass
class StreamDelta:
    """One token of a stream: its id and logprob, the text it completes (empty while a
    character's bytes are still arriving) and, on the last delta (no token),
    `finish_reason` and the request's `speculation`."""

    token_id: Optional[int]
    logprob: Optional[float]
    text: str
    top_logprobs: List[Tuple[int, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    speculation: Optional["Speculation"] = None


@dataclass
class ChatOutput:
    """An answered chat: the reply's text (`content`), its reasoning when the template marks
    one, its tool calls (`{"id", "type", "function": {"name", "arguments"}}`, OpenAI's
    shape), `finish_reason`, and the whole OpenAI response as `response`."""

    text: Optional[str]
    reasoning: Optional[str]
    tool_calls: List[Dict[str, Any]]
    finish_reason: str
    response: Dict[str, Any]


class Tokenizer:
    """The target's tokenizer (prompts are encoded as `encode` does)."""

    def __init__(self, engine: "_mtp.Engine") -> None:
        self._engine = engine

    def encode(self, text: str) -> List[int]:
        return self._engine.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._engine.decode(list(token_ids))


class Server:
    """An OpenAI-compatible server over an `LLM`'s engine, listening at `url` (its `/v1`
    endpoints, `/health`, `/metrics`). `stop()` ends it; `wait()` serves until Ctrl-C."""

    def __init__(self, url: str, handle: "_mtp.Serving", llm: "LLM") -> None:
        self.url = url
        self._handle = handle
        self.llm = llm

    def stop(self) -> None:
        self._handle.stop()

    def wait(self) -> None:
        import time

        try:
            while True:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LLM:
    """A target checkpoint (a directory, a `.gguf` file or a Hugging Face repo id; none: the
    small trained family shipped in the repository) with its drafter, on one engine.

    The arguments are `mtp generate`'s flags (docs/cli.md): `drafter` is auto, none,
    draft-model, mtp, eagle3, assistant or ngram; `draft` the draft checkpoint; `k` "auto" or
    a count; `sampling` "exact" (bitwise plain sampling) or "rejection"."""

    def __init__(
        self,
        target: Optional[Union[str, "os.PathLike[str]"]] = None,
        draft: Optional[Union[str, "os.PathLike[str]"]] = None,
        drafter: str = "auto",
        backend: str = "cpu",
        max_batch: int = 8,
        kv_dtype: str = "auto",
        tensor_parallel: int = 1,
        *,
        k: Union[str, int] = "auto",
        max_k: int = 8,
        ngram_min: int = 1,
        ngram_max: int = 4,
        kv_bits: Optional[int] = None,
        activations: str = "auto",
        kv_budget_mib: Optional[int] = None,
        prefill_chunk: Optional[int] = None,
        sampling: str = "exact",
        prefix_cache_mib: int = 256,
        max_pending: int = 256,
        served_model_name: Optional[str] = None,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        chat_template: Optional[Union[str, "os.PathLike[str]"]] = None,
    ) -> None:
        self._engine = _mtp.Engine(
            target=None if target is None else os.fspath(target),
            draft=None if draft is None else os.fspath(draft),
            drafter=drafter,
            backend=backend,
            max_batch=max_batch,
            k=str(k),
            max_k=max_k,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
            kv_dtype=kv_dtype,
            kv_bits=kv_bits,
            activations=activations,
            tensor_parallel=tensor_parallel,
            kv_budget_mib=kv_budget_mib,
            prefill_chunk=prefill_chunk,
            sampling=sampling,
            prefix_cache_mib=prefix_cache_mib,
            max_pending=max_pending,
            served_model_name=served_model_name,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            chat_template=None if chat_template is None else os.fspath(chat_template),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self._engine)

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    def stats(self) -> Dict[str, Any]:
        """The engine's counters since it started: rounds, drafted and accepted tokens,
        acceptance_rate, mean_accepted_length (tokens per target forward per request),
        estimated_speedup over plain decoding, prompt tokens (and those from the prefix
        cache), preemptions, generated_tokens, running and waiting requests."""
        return self._engine.stats()

    def _submit(self, prompt: Prompt, params: SamplingParams, name: str) -> "_mtp.Stream":
        """Submits one request; `name` is how errors name it (`prompts[2]`)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be mtp.SamplingParams (or a list of them)")
        line = json.dumps(params._line(prompt, name))
        return self._engine.submit(line, name, params.max_tokens, params.ignore_eos)

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> List[RequestOutput]:
        """Runs every prompt (text, or a list of token ids) to completion, batched, and
        returns one output per prompt in order. `sampling_params` is one for all or one per
        prompt. A prompt the engine refuses raises `mtp.Error` naming it (`request
        prompts[2]: ...`), and the others are cancelled."""
        many = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(many)
        else:
            params = list(sampling_params)
            if len(params) != len(many):
                raise ValueError(f"{len(params)} sampling_params for {len(many)} prompts: give one, or one per prompt")
        streams: List["_mtp.Stream"] = []
        try:
            for i, (p, sp) in enumerate(zip(many, params)):
                streams.append(self._submit(p, sp, f"prompts[{i}]"))
            return [self._collect(i, p, sp, s) for i, (p, sp, s) in enumerate(zip(many, params, streams))]
        finally:
            # Nothing left running on an error or Ctrl-C (a no-op for finished streams).
            for s in streams:
                s.cancel()

    def _collect(self, i: int, prompt: Prompt, params: SamplingParams, s: "_mtp.Stream") -> RequestOutput:
        tokens: List[int] = []
        logprobs: List[float] = []
        tops: List[List[Tuple[int, float]]] = []
        prompt_scores = None
        spec = Speculation()
        while True:
            ev = s.next(_POLL_S)
            if ev is None:
                continue
            kind = ev[0]
            if kind == "token":
                tokens.append(ev[1])
                logprobs.append(ev[2])
                tops.append(ev[3])
            elif kind == "prompt":
                prompt_scores = ev[1]
            elif kind == "verified":
                spec.verifies += 1
                spec.drafted += ev[1]
                spec.accepted += ev[2]
            elif kind == "finished":
                text = self._engine.decode(tokens) if self._engine.has_tokenizer() else ""
                return RequestOutput(
                    request_id=str(i),
                    prompt=prompt,
                    text=text,
                    token_ids=tokens,
                    logprobs=logprobs,
                    finish_reason=ev[1],
                    top_logprobs=tops if params.logprobs else None,
                    prompt_logprobs=prompt_scores,
                    speculation=spec,
                )
            else:
                raise Error("the request ended without finishing")

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[StreamDelta]:
        """Yields the request's tokens as they are generated (they are exactly those
        `generate` returns). Closing the iterator early (`break`) cancels the request."""
        params = sampling_params or SamplingParams()
        s = self._submit(prompt, params, "prompt")
        tok = self._engine.has_tokenizer()
        tokens: List[int] = []
        shown = ""
        spec = Speculation()
        try:
            while True:
                ev = s.next(_POLL_S)
                if ev is None:
                    continue
                if ev[0] == "token":
                    tokens.append(ev[1])
                    text = ""
                    if tok:
                        full = self._engine.decode(tokens)
                        # A character whose bytes are still arriving decodes as U+FFFD: wait for it.
                        if not full.endswith("\ufffd") and full.startswith(shown):
                            text, shown = full[len(shown):], full
                    yield StreamDelta(token_id=ev[1], logprob=ev[2], text=text, top_logprobs=ev[3])
                elif ev[0] == "verified":
                    spec.verifies += 1
                    spec.drafted += ev[1]
                    spec.accepted += ev[2]
                elif ev[0] == "finished":
                    rest = ""
                    if tok:
                        full = self._engine.decode(tokens)
                        rest = full[len(shown):] if full.startswith(shown) else ""
                    yield StreamDelta(token_id=None, logprob=None, text=rest, finish_reason=ev[1], speculation=spec)
                    return
                elif ev[0] == "ended":
                    return
        finally:
            s.cancel()

    def chat(
        self,
        messages: List[Dict[str, Any]],
        sampling_params: Optional[SamplingParams] = None,
        *,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice: Union[str, Dict[str, Any], None] = None,
        response_format: Optional[Dict[str, Any]] = None,
        **extra: Any,
    ) -> ChatOutput:
        """One chat turn with the checkpoint's template, answered as `/v1/chat/completions`
        answers it (in-process, no socket): `messages` and `tools` in OpenAI's shape, the
        reply's tool calls and reasoning parsed out. Other OpenAI fields go in `extra`
        (`parallel_tool_calls`, `chat_template_kwargs`, ...). A refusal raises `mtp.Error`
        with the server's message."""
        p = sampling_params or SamplingParams()
        body: Dict[str, Any] = {
            "model": self._engine.model_name,
            "messages": messages,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed,
        }
        if p.top_k not in (0, -1):
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.stop is not None:
            body["stop"] = p.stop
        if p.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = p.logprobs
        if tools is not None:
            body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
        if response_format is not None:
            body["response_format"] = response_format
        body.update(extra)
        call = self._engine.chat(json.dumps(body))
        try:
            while True:
                answer = call.poll(_POLL_S)
                if answer is not None:
                    break
        finally:
            call.cancel()
        status, text = answer
        response = json.loads(text) if text else {}
        if status != 200:
            err = response.get("error", {}) if isinstance(response, dict) else {}
            raise Error(f"chat: {err.get('message', text)} (HTTP {status})")
        choice = response["choices"][0]
        message = choice["message"]
        return ChatOutput(
            text=message.get("content"),
            reasoning=message.get("reasoning_content"),
            tool_calls=message.get("tool_calls") or [],
            finish_reason=choice["finish_reason"],
            response=response,
        )

    def serve(self, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None) -> Server:
        """Serves the OpenAI API over this engine (shared with `generate`) from a
        background thread; port 0 picks a free one (see `Server.url`)."""
        url, handle = self._engine.serve(host, port, api_key)
        return Server(url, handle, self)


def serve(
    target: Optional[Union[str, "os.PathLike[str]"]] = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: Optional[str] = None,
    **llm_args: Any,
) -> Server:
    """`mtp serve` in-process: loads `target` as `LLM(target, **llm_args)` and serves it.
    `server.wait()` blocks until Ctrl-C."""
    return LLM(target, **llm_args).serve(host=host, port=port, api_key=api_key)


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> List[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]
    for i, p in enumerate(items):
        if not isinstance(p, str) and not (
            isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            raise TypeError(f"prompts[{i}]: a prompt is a str or a list of token ids (int)")
    return items
