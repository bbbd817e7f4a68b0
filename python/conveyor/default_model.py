"""The built-in default model, SmolLM2-135M-Instruct (Q4_1 GGUF), under its older module name.

Everything lives in conveyor.models; this module keeps the names scripts use and the
command CI runs to fetch the model before the tests:

    python -m conveyor.default_model          # fetch it now, print the path
    conveyor fetch-model                      # the same
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Optional

from .fetch import FetchError as DefaultModelError
from .fetch import cache_dir, sha256_file
from .models import BUILTIN_MODELS, DEFAULT_MODEL, default_model_path, fetch_model, find_model, main_for, \
    resolve_model

__all__ = ["MODEL_FILE", "MODEL_SHA256", "MODEL_BYTES", "DefaultModelError", "cache_dir",
           "sha256_file", "find_default_model", "fetch_default_model", "resolve_default_model", "default_model_path",
           "main"]

_MODEL = BUILTIN_MODELS[DEFAULT_MODEL]
MODEL_FILE, MODEL_SHA256, MODEL_BYTES = _MODEL.file, _MODEL.sha256, _MODEL.size
find_default_model = partial(find_model, DEFAULT_MODEL)
fetch_default_model = partial(fetch_model, DEFAULT_MODEL)
main = main_for(DEFAULT_MODEL)


def resolve_default_model(*, fetch: bool = True) -> Optional[Path]:
    """The default model's file, fetched when allowed; None (with a message on stderr
    naming `conveyor fetch-model`) when it is not here and cannot be fetched."""
    try:
        return Path(resolve_model(DEFAULT_MODEL, fetch=fetch))
    except DefaultModelError as e:
        print(f"conveyor: the default model is not available: {e}", file=sys.stderr, flush=True)
        return None


if __name__ == "__main__":
    raise SystemExit(main())
