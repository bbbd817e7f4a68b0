"""One byte budget per request, checked before any work that grows with it.

Every field a request carries that costs work in proportion to its size (its prompt
or messages, bad words, stop strings, choices, schemas, logit bias, allowed ids,
tools) is charged against one budget, in a fixed order, before anything is tokenized
or compiled; the field that goes over is named in the error (a 400 on that field from
the server). The sizes are counted without copying: strings by their UTF-8 length,
numbers as 8 bytes, containers by what they hold, with the walk itself stopping at
the budget, so that counting costs no more than the budget.
"""
from __future__ import annotations

from typing import Any, Iterable

from .sampling_params import field_error

# The budget of one request to an engine: the most prompt text its context can take
# (EngineCore.max_prompt_bytes: 2 x max_model_len x the longest token) and this much
# for everything else, far above real bad words, stop strings, schemas and tools, far
# below what stalls a server (tokenizing 15 MB of bad words took 10 s; turning 2 MB of
# them into token arrays holds the GIL for tens of milliseconds).
REQUEST_BUDGET_EXTRA_BYTES = 256 << 10
# The budget when no engine says how much prompt it takes.
REQUEST_BUDGET_BYTES = 2 << 20
# What each sequence a request runs (prompts x max(n, best_of)) costs: the engine
# copies the request's controls and keeps per-sequence state for each.
SEQUENCE_BYTES = 64


def request_budget_bytes(max_prompt_bytes: int) -> int:
    """The budget of a request to an engine whose prompts take at most max_prompt_bytes."""
    return int(max_prompt_bytes) + REQUEST_BUDGET_EXTRA_BYTES
_SCALAR_BYTES = 8


def text_bytes(s: str) -> int:
    """The UTF-8 size of s (its length when ASCII, which Python knows at once)."""
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def value_bytes(value: Any, limit: int) -> int:
    """The size of a JSON-like value (dicts, lists, strings, scalars): strings by their
    UTF-8 length and quotes (keys too), everything else 8 bytes. Stops counting once past
    ``limit`` (returns a number > limit), so a huge value costs no more than that."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += text_bytes(v) + 2
        elif isinstance(v, dict):
            total += _SCALAR_BYTES
            for k, item in v.items():
                total += (text_bytes(k) + 2) if isinstance(k, str) else _SCALAR_BYTES
                stack.append(item)
                if total + len(stack) > limit:
                    return total + len(stack)  # every value left counts at least a byte
        elif isinstance(v, (list, tuple)):
            total += _SCALAR_BYTES
            if total + len(stack) + len(v) > limit:
                return total + len(stack) + len(v)
            stack.extend(v)
        else:
            total += _SCALAR_BYTES
    return total


class RequestBudget:
    """The bytes one request may bring; charge() each field before working on it."""

    def __init__(self, limit: int = REQUEST_BUDGET_BYTES):
        self.limit = int(limit)
        self.used = 0

    def charge(self, field: str, value: Any) -> None:
        """Adds value's size; past the budget, a ValueError whose .field is ``field``."""
        if value is None:
            return
        self.charge_bytes(field, value_bytes(value, self.limit - self.used))

    def charge_bytes(self, field: str, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise field_error(ValueError, field,
                              f"'{field}' takes the request past its budget of {self.limit} bytes "
                              f"(every field's size counts: prompt or messages, bad_words, stop, "
                              f"schemas, logit_bias, allowed_token_ids, tools, and "
                              f"{SEQUENCE_BYTES} bytes per sequence)")

    def charge_fields(self, obj: dict, fields: Iterable[str]) -> None:
        for name in fields:
            self.charge(name, obj.get(name))
