"""What generation returns (vLLM's shapes): RequestOutput with CompletionOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class RequestMetrics:
    """Times are time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop", "length" or "abort"
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
    # prompt_logprobs=k: None for the first prompt token, then {token id: Logprob}
    # with the prompt token and the k most likely tokens at each position
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # guided decoding: why the grammar engine ended a completion ("abort") midway, a
    # grammar past its limits; or why a completion's constraints (allowed_token_ids,
    # bad_words, min_tokens, the grammar) left no token (finish_reason "error").
    # AsyncLLM's streams raise it as a ValueError
    guided_error: Optional[str] = None
