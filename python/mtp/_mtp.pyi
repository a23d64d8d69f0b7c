"""Type stubs of the native half (python/src/lib.rs); the API is `mtp` itself."""

from typing import Any, Dict, List, Optional, Tuple, Union

class Error(Exception): ...

Event = Union[
    Tuple[str, int, float, List[Tuple[int, float]]],
    Tuple[str, List[Tuple[int, float, int, List[Tuple[int, float]]]]],
    Tuple[str, str],
    Tuple[str],
]

class Stream:
    def next(self, timeout: float) -> Optional[Event]: ...
    def cancel(self) -> None: ...

class Call:
    def poll(self, timeout: float) -> Optional[Tuple[int, str]]: ...
    def cancel(self) -> None: ...

class Serving:
    def stop(self) -> None: ...

class Engine:
    model_name: str
    target_dir: str
    vocab_size: int
    max_positions: int
    eos_token_ids: List[int]
    def __init__(
        self,
        *,
        target: Optional[str],
        draft: Optional[str],
        drafter: str,
        backend: str,
        max_batch: int,
        k: str,
        max_k: int,
        ngram_min: int,
        ngram_max: int,
        kv_dtype: str,
        kv_bits: Optional[int],
        activations: str,
        tensor_parallel: int,
        kv_budget_mib: Optional[int],
        prefill_chunk: Optional[int],
        sampling: str,
        prefix_cache_mib: int,
        max_pending: int,
        served_model_name: Optional[str],
        tool_parser: str,
        reasoning_parser: str,
        chat_template: Optional[str],
    ) -> None: ...
    def submit(self, line: str, default_id: str, max_tokens: int, ignore_eos: bool) -> Stream: ...
    def chat(self, body: str) -> Call: ...
    def serve(self, host: str, port: int, api_key: Optional[str] = None) -> Tuple[str, Serving]: ...
    def encode(self, text: str) -> List[int]: ...
    def decode(self, ids: List[int]) -> str: ...
    def has_tokenizer(self) -> bool: ...
    def stats(self) -> Dict[str, Any]: ...
