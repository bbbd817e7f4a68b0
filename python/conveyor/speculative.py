"""speculative_config (issue 26): its parsing, and the acceptance figures.

The engine (csrc/core/speculative.c, engine_sample.c) proposes, verifies and
rolls back; docs/speculative.md describes how.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .sampling_params import field_error

# speculative_config: no proposals in a step while more sequences than this run
# (docs/speculative.md: where verifying proposals stops paying on the CPU).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 4
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size")


def parse_speculative_config(cfg) -> Optional[dict]:
    """speculative_config (a dict, or a JSON object string) as the engine takes it:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b, "disable_by_batch_size": n}. Types and keys are checked
    here; the C engine checks every range and names the field at fault."""
    if cfg is None:
        return None
    if isinstance(cfg, str):
        import json

        try:
            cfg = json.loads(cfg)
        except ValueError as e:
            raise ValueError(f"speculative_config: not a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(cfg).__name__}")
    if "model" in cfg:
        raise field_error(ValueError, "model", "speculative_config: draft models are not supported yet; "
                                               "use {\"method\": \"ngram\", ...}")
    unknown = sorted(set(cfg) - set(_SPEC_KEYS))
    if unknown:
        raise field_error(ValueError, unknown[0], f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                                                  f"known: {', '.join(_SPEC_KEYS)}")
    method = cfg.get("method", "ngram")
    if method != "ngram":
        raise field_error(ValueError, "method", f"speculative_config: method must be 'ngram', got {method!r}")
    if "num_speculative_tokens" not in cfg:
        raise field_error(ValueError, "num_speculative_tokens",
                          "speculative_config: num_speculative_tokens is required")
    for key in _SPEC_KEYS[1:]:
        v = cfg.get(key)
        if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)):
            raise field_error(TypeError, key, f"speculative_config: {key} must be an int, got {type(v).__name__}")
    lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
    if lo is None:
        lo = min(2, hi) if hi is not None else 2
    if hi is None:
        hi = max(4, lo)
    disable = cfg.get("disable_by_batch_size")
    return {"method": method, "num_speculative_tokens": int(cfg["num_speculative_tokens"]),
            "prompt_lookup_min": int(lo), "prompt_lookup_max": int(hi),
            "disable_by_batch_size": DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE if disable is None else int(disable)}


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
