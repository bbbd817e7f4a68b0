"""SamplingParams: how one request is sampled and when it stops (vLLM's names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

MAX_LOGPROBS = 20
_OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name, value, lo=None, hi=None, allow_none=False):
    if value is None and allow_none:
        return
    if not _is_int(value):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"SamplingParams.{name} must be in {rng}, got {value}")


def _check_float(name, value, lo, hi, lo_open=False, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    v = float(value)
    ok = math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ValueError(
            f"SamplingParams.{name} must be a finite number in {left}{lo if lo is not None else '-inf'}, "
            f"{hi if hi is not None else 'inf'}{right}, got {value!r}")


@dataclass
class SamplingParams:
    """Sampling and stopping for one request; validated when built.

    temperature 0 means greedy (argmax). top_k 0 or -1 turns top-k off.
    stop strings are matched on the detokenized text; the returned text ends
    before the stop string unless include_stop_str_in_output is set.
    output_kind (AsyncLLM streaming): "cumulative" (default), "delta" or "final_only".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"
    _stop_list: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_int("n", self.n, 1, 1024)
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, -(2**63), 2**64 - 1, allow_none=True)
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= "
                             f"max_tokens ({self.max_tokens})")
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool")
        if self.output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"SamplingParams.output_kind must be one of {_OUTPUT_KINDS}, "
                             f"got {self.output_kind!r}")
        if self.stop is None:
            stops = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            stops = list(self.stop)
        else:
            raise TypeError("SamplingParams.stop must be a str or a list of str")
        for s in stops:
            if not isinstance(s, str):
                raise TypeError("SamplingParams.stop must contain only str")
            if s == "":
                raise ValueError("SamplingParams.stop must not contain an empty string")
        self._stop_list = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError("SamplingParams.stop_token_ids must be a list of int")
            for t in self.stop_token_ids:
                if not _is_int(t):
                    raise TypeError("SamplingParams.stop_token_ids must contain only int")
                if t < 0:
                    raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {t}")

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stop_list)

    def clone(self, **changes) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
