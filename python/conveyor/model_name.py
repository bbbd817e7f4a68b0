"""The short name of a model given by path: what the server answers to (and shows
in /v1/models) unless --served-model-name says otherwise.

    a built-in model's file -> its built-in name (SmolLM2-135M-Instruct, gemma-3-270m, stories260K)
    other file              -> the file stem     (smol-q8.gguf -> "smol-q8")
    directory               -> its name          (.../SmolLM2-135M/ -> "SmolLM2-135M")

A GGUF file's general.name is not used: it is whatever the converter wrote ("Smollm2
135M 8k Lc100K Mix1 Ep2"), not a name a user would type.
"""
from __future__ import annotations

import os

from .models import BUILTIN_MODELS


def model_name(path: str | os.PathLike) -> str:
    p = os.path.normpath(os.fspath(path))
    base = os.path.basename(p) or p
    if os.path.isdir(p):
        return base
    for m in BUILTIN_MODELS.values():  # a built-in model's file -> the name users know it by
        if base == m.file:
            return m.name
    stem, _ = os.path.splitext(base)
    return stem or base
