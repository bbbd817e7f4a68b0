"""Gemma 3 270M in Q4_K_M (the built-in name "gemma-3-270m"), under its older module name.

Everything lives in conveyor.models; this module keeps the names scripts use:

    python -m conveyor.gemma3_model            # fetch it now, print the path
    conveyor fetch-model gemma-3-270m          # the same
"""
from __future__ import annotations

from functools import partial

from .fetch import FetchError as Gemma3FetchError
from .models import BUILTIN_MODELS, fetch_model, find_model, main_for, resolve_model

__all__ = ["NAME", "MODEL_FILE", "MODEL_SHA256", "MODEL_BYTES", "Gemma3FetchError",
           "find_gemma3_model", "fetch_gemma3_model", "resolve_model_name", "main"]

NAME = "gemma-3-270m"
_MODEL = BUILTIN_MODELS[NAME]
MODEL_FILE, MODEL_SHA256, MODEL_BYTES = _MODEL.file, _MODEL.sha256, _MODEL.size
find_gemma3_model = partial(find_model, NAME)
fetch_gemma3_model = partial(fetch_model, NAME)
main = main_for(NAME)


def resolve_model_name(model: str) -> str:
    """``model`` as the engine loads it: a path as given, a built-in name as its file
    (fetched once); a name that cannot be resolved is returned as given, for the engine
    to report."""
    try:
        return resolve_model(model)
    except (OSError, Gemma3FetchError):
        return model


if __name__ == "__main__":
    raise SystemExit(main())
