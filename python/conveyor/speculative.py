"""speculative_config: its parsing, and the acceptance figures.

The engine (csrc/core/speculative.c, engine_sample.c) proposes, verifies and
rolls back; docs/speculative.md describes how.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from .fetch import FetchError
from .models import resolve_model
from .sampling_params import field_error

# speculative_config: no proposals in a step while more sequences than this run
# (docs/speculative.md: where verifying proposals stops paying on the CPU).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 4
_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "disable_by_batch_size")
_DRAFT_KEYS = ("method", "model", "num_speculative_tokens", "disable_by_batch_size")
_SPEC_KEYS = tuple(dict.fromkeys(_NGRAM_KEYS + _DRAFT_KEYS))
_METHODS = ("ngram", "draft_model")
# The integer fields cross into C as int64; their ranges are the engine's to check.
_INT64 = (-(1 << 63), (1 << 63) - 1)


def parse_speculative_config(cfg) -> Optional[dict]:
    """speculative_config (a dict, or a JSON object string) as the engine takes it:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b, "disable_by_batch_size": n}, or a draft model:
    {"model": PATH, "num_speculative_tokens": k, "disable_by_batch_size": n}
    ("method": "draft_model" is implied by "model"). Types, keys and the draft's
    path are checked here; the C engine checks every range and the draft's
    vocabulary, and names the field at fault."""
    if cfg is None:
        return None
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError as e:
            raise ValueError(f"speculative_config: not a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(_SPEC_KEYS), key=str)
    if unknown:
        raise field_error(ValueError, str(unknown[0]), f"speculative_config: unknown key(s) "
                                                       f"{', '.join(map(str, unknown))}; known: {', '.join(_SPEC_KEYS)}")
    method = cfg.get("method", "draft_model" if "model" in cfg else "ngram")
    if method not in _METHODS:
        raise field_error(ValueError, "method", f"speculative_config: method must be one of {_METHODS}, "
                                                f"got {method!r}")
    allowed = _DRAFT_KEYS if method == "draft_model" else _NGRAM_KEYS
    wrong = sorted(set(cfg) - set(allowed))
    if wrong:
        raise field_error(ValueError, wrong[0], f"speculative_config: {wrong[0]} does not apply to method "
                                                f"{method!r} (its keys: {', '.join(allowed)})")
    if cfg.get("num_speculative_tokens") is None:
        raise field_error(ValueError, "num_speculative_tokens",
                          "speculative_config: num_speculative_tokens is required (an int)")
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        v = cfg.get(key)
        if v is None:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise field_error(TypeError, key, f"speculative_config: {key} must be an int, got {type(v).__name__}")
        if not _INT64[0] <= int(v) <= _INT64[1]:
            raise field_error(ValueError, key, f"speculative_config: {key} = {int(v)} does not fit a 64-bit "
                                               f"integer")
    disable = cfg.get("disable_by_batch_size")
    out = {"method": method, "num_speculative_tokens": int(cfg["num_speculative_tokens"]),
           "disable_by_batch_size": DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE if disable is None else int(disable)}
    if method == "draft_model":
        out["model"] = _draft_path(cfg.get("model"))
        return out
    lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
    if lo is None:
        lo = min(2, hi) if hi is not None else 2
    if hi is None:
        hi = max(4, lo)
    out.update(prompt_lookup_min=int(lo), prompt_lookup_max=int(hi))
    return out


def _draft_path(model) -> str:
    """The draft checkpoint's path: a file or folder that exists, or a model name
    (conveyor.models: the built-in names, fetched once), as for the target."""
    if model is None:
        raise field_error(ValueError, "model", "speculative_config: method 'draft_model' needs a model path")
    if not isinstance(model, (str, os.PathLike)):
        raise field_error(TypeError, "model", f"speculative_config: model must be a path, got {type(model).__name__}")
    try:
        return resolve_model(model)
    except (OSError, ValueError, FetchError) as e:
        raise field_error(ValueError, "model", f"speculative_config: draft model: {e}") from None


def spec_stats(st: dict, k: int) -> dict:
    """The speculative figures of engine stats ``st`` (or of a difference of two):
    proposals verified and accepted by position (lists of k), and the acceptance
    rates, overall and by position."""
    prop, acc = list(st["spec_proposed_at"][:k]), list(st["spec_accepted_at"][:k])
    return {"spec_proposed_at": prop, "spec_accepted_at": acc,
            "spec_acceptance_rate_at": [a / p if p else 0.0 for a, p in zip(acc, prop)],
            "spec_acceptance_rate": st["spec_accepted"] / st["spec_proposed"] if st["spec_proposed"] else 0.0}


def spec_delta(before: dict, after: dict, k: int) -> dict:
    """spec_stats of what happened between two stats() snapshots."""
    d = {key: after[key] - before[key] for key in ("spec_proposed", "spec_accepted", "spec_steps_disabled")}
    for key in ("spec_proposed_at", "spec_accepted_at"):
        d[key] = [a - b for a, b in zip(after[key], before[key])]
    d.update(spec_stats(d, k))
    return d


def format_spec(d: dict) -> str:
    """One line: proposed, accepted, the rate overall and by position."""
    rates = " ".join(f"{r:.2f}" for r in d["spec_acceptance_rate_at"])
    return (f"speculative: {d['spec_proposed']} proposed, {d['spec_accepted']} accepted "
            f"({d['spec_acceptance_rate']:.1%}); by position: {rates}")
