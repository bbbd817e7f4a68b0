"""Gemma 3 270M in Q4_K_M (the built-in name "gemma-3-270m"), under its older module name.

Everything lives in conveyor.models; this module keeps the names scripts use:

    python -m conveyor.gemma3_model            # fetch it now, print the path
    conveyor fetch-model gemma-3-270m          # the same
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .fetch import FetchError as Gemma3FetchError
from .models import BUILTIN_MODELS, fetch_main, fetch_model, find_model, resolve_model

__all__ = ["NAME", "MODEL_FILE", "MODEL_SHA256", "MODEL_BYTES", "Gemma3FetchError",
           "find_gemma3_model", "fetch_gemma3_model", "resolve_model_name", "main"]

NAME = "gemma-3-270m"
_MODEL = BUILTIN_MODELS[NAME]
MODEL_FILE = _MODEL.file
MODEL_SHA256 = _MODEL.sha256
MODEL_BYTES = _MODEL.size


def find_gemma3_model() -> Optional[Path]:
    """The cached file when it is there with the right size, else None."""
    return find_model(NAME)


def fetch_gemma3_model() -> Path:
    """The file, fetched into the cache when it is not there yet."""
    return fetch_model(NAME)


def resolve_model_name(model: str) -> str:
    """``model`` as the engine loads it: a path as given, a built-in name as its file
    (fetched once); a name that cannot be resolved is returned as given, for the engine
    to report."""
    try:
        return resolve_model(model)
    except (OSError, Gemma3FetchError):
        return model


def main(argv: Sequence[str] | None = None) -> int:
    return fetch_main([NAME, *(argv or [])] if argv is not None else [NAME])


if __name__ == "__main__":
    import sys

    raise SystemExit(fetch_main([NAME, *sys.argv[1:]]))
