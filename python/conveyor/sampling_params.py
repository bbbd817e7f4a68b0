"""SamplingParams: how one request is sampled and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from . import _core
from .guided import GuidedDecodingParams  # noqa: F401  (vLLM's import path)

MAX_LOGPROBS = _core.MAX_LOGPROBS  # the C engine's limit (CV_MAX_LOGPROBS)
MAX_BAD_WORDS = _core.MAX_BAD_WORDS  # the C engine's limit (CV_MAX_BAD_WORDS), checked before tokenizing
_OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def field_error(exc_type: type, field_name: str, message: str) -> Exception:
    """An exception naming the request field at fault in .field, as the C
    engine's errors do (the server answers it as a 400 with that param)."""
    e = exc_type(message)
    e.field = field_name
    return e


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if not _is_int(value):
        raise field_error(TypeError, name, f"SamplingParams.{name} must be an int, got {type(value).__name__}")


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise field_error(TypeError, name, f"SamplingParams.{name} must be a number, got {type(value).__name__}")


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)):
        raise field_error(TypeError, "stop", "SamplingParams.stop must be a str or a list of str")
    for s in stop:
        if not isinstance(s, str):
            raise field_error(TypeError, "stop", "SamplingParams.stop must contain only str")
    return list(stop)


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
    # Guided decoding (conveyor.guided): a GuidedDecodingParams, or a dict of its fields.
    guided_decoding: Optional[Any] = None
    # ---- prompt logprobs and logit controls ----
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    best_of: Optional[int] = None
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False,
                                                            compare=False)

    def __post_init__(self):
        self._plain_numbers()
        # Types here; every range is the C engine's (conveyor._core.check_sampling_params).
        _check_int("n", self.n)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check_number(name, getattr(self, name))
        _check_int("top_k", self.top_k)
        _check_int("seed", self.seed, allow_none=True)
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        _check_int("min_tokens", self.min_tokens)
        _check_int("logprobs", self.logprobs, allow_none=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(TypeError, name, f"SamplingParams.{name} must be a bool")
        if self.output_kind not in _OUTPUT_KINDS:
            raise field_error(ValueError, "output_kind", f"SamplingParams.output_kind must be one of "
                              f"{_OUTPUT_KINDS}, got {self.output_kind!r}")
        _stop_list(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise field_error(TypeError, "stop_token_ids", "SamplingParams.stop_token_ids must be a list of int")
            for t in self.stop_token_ids:
                if not _is_int(t):
                    raise field_error(TypeError, "stop_token_ids",
                                      "SamplingParams.stop_token_ids must contain only int")
        if self.guided_decoding is not None:
            from .guided import coerce_guided

            self.guided_decoding = coerce_guided(self.guided_decoding)
        self._check_logit_controls()
        try:
            _core.check_sampling_params(self)
        except (TypeError, ValueError) as e:
            raise field_error(type(e), getattr(e, "field", None), f"SamplingParams.{e}") from None

    def _plain_numbers(self):
        """NumPy scalars (an int64 from an array, a float32) as the Python numbers they
        hold, and NumPy ints in the token-id lists, so that every later check and the
        engine see plain ints and floats."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, np.integer):
                setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, (np.floating, np.integer)):
                setattr(self, name, float(v))
        for name in ("stop_token_ids", "allowed_token_ids"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)) and any(isinstance(t, np.integer) for t in v):
                setattr(self, name, [int(t) if isinstance(t, np.integer) else t for t in v])
        if isinstance(self.logit_bias, dict) and any(isinstance(k, np.integer) or isinstance(b, np.floating)
                                                     for k, b in self.logit_bias.items()):
            self.logit_bias = {int(k) if isinstance(k, np.integer) else k: float(b) if isinstance(b, np.floating) else b
                               for k, b in self.logit_bias.items()}

    def _check_logit_controls(self):
        """Types only; the ranges are the C engine's."""
        _check_int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        _check_int("best_of", self.best_of, allow_none=True)
        if self.best_of is not None and self.best_of < 1:  # the engine reads 0 as unset
            raise field_error(ValueError, "best_of", f"SamplingParams.best_of must be in [n, 1024] or None, "
                              f"got {self.best_of}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise field_error(TypeError, "logit_bias", "SamplingParams.logit_bias must be a dict "
                                  "{token id: bias}")
            for k, v in self.logit_bias.items():
                if not _is_int(k):
                    raise field_error(TypeError, "logit_bias", f"SamplingParams.logit_bias keys must be "
                                      f"int token ids, got {k!r}")
                _check_number("logit_bias", v)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(
                    _is_int(t) for t in self.allowed_token_ids):
                raise field_error(TypeError, "allowed_token_ids",
                                  "SamplingParams.allowed_token_ids must be a list of int")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)) or \
                    not all(isinstance(w, str) for w in self.bad_words):
                raise field_error(TypeError, "bad_words", "SamplingParams.bad_words must be a list of str")
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise field_error(ValueError, "bad_words", f"SamplingParams.bad_words has {len(self.bad_words)} "
                                  f"words; at most {MAX_BAD_WORDS} are allowed")
            for w in self.bad_words:
                if not w.strip():
                    raise field_error(ValueError, "bad_words", "SamplingParams.bad_words must not contain "
                                      "an empty word")
                try:
                    w.encode("utf-8")
                except UnicodeEncodeError:
                    raise field_error(ValueError, "bad_words", "SamplingParams.bad_words: a word is not valid "
                                      "text (a lone surrogate)") from None

    def with_bad_words_tokenized(self, tokenizer) -> "SamplingParams":
        """A copy whose bad_words are token sequences (vLLM's rule: each word
        as written and with a leading space, when that tokenizes differently).
        tokenizer: anything with encode_batch (a Tokenizer, or a CachedEncoder over one)."""
        out = self.clone()
        if not self.bad_words:
            return out
        if tokenizer is None:
            raise field_error(ValueError, "bad_words", "bad_words needs a tokenizer")
        texts = [text for w in self.bad_words for text in (w.lstrip(), " " + w.lstrip())]
        seqs: list[list[int]] = []
        seen: set[tuple] = set()  # a set: de-duplicating stays linear in the number of words
        for ids in tokenizer.encode_batch(texts, add_special_tokens=False):  # one call for all
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                seqs.append(list(ids))
        out._bad_words_token_ids = seqs
        return out

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, read when a request starts (a change after
        construction counts, and is checked again)."""
        return _stop_list(self.stop)

    def clone(self, **changes) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
