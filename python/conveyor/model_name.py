"""The short name of a model given by path: what the server answers to (and shows
in /v1/models) unless --served-model-name says otherwise.

    GGUF file      -> its general.name metadata when present, else the file stem
    other file     -> the file stem            (stories260K.bin -> "stories260K")
    directory      -> the directory's name     (.../SmolLM2-135M/ -> "SmolLM2-135M")
"""
from __future__ import annotations

import os
import struct
from typing import BinaryIO, Optional

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types -> fixed sizes (8: string, 9: array are variable).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 4096         # metadata keys looked at before giving up
_MAX_STRING = 1 << 20    # longer strings mean a broken file


def model_name(path: str | os.PathLike) -> str:
    p = os.path.normpath(os.fspath(path))
    base = os.path.basename(p) or p
    if os.path.isdir(p):
        return base
    stem, ext = os.path.splitext(base)
    if ext.lower() == ".gguf":
        name = gguf_general_name(p)
        if name:
            return name
    return stem or base


def gguf_general_name(path: str) -> Optional[str]:
    """general.name from a GGUF file's metadata, or None (absent, or not readable GGUF)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                return None
            version, = struct.unpack("<I", _read(f, 4))
            if version < 2:
                return None  # version 1 used 32-bit lengths; not worth reading for a name
            _n_tensors, n_kv = struct.unpack("<QQ", _read(f, 16))
            for _ in range(min(n_kv, _MAX_KEYS)):
                key = _string(f)
                vtype, = struct.unpack("<I", _read(f, 4))
                if key == "general.name" and vtype == _STRING:
                    return _string(f).strip() or None
                _skip_value(f, vtype)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return None


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise ValueError("truncated GGUF metadata")
    return b


def _string(f: BinaryIO) -> str:
    n, = struct.unpack("<Q", _read(f, 8))
    if n > _MAX_STRING:
        raise ValueError("GGUF string too long")
    return _read(f, n).decode("utf-8")


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype in _FIXED:
        f.seek(_FIXED[vtype], os.SEEK_CUR)
    elif vtype == _STRING:
        n, = struct.unpack("<Q", _read(f, 8))
        f.seek(n, os.SEEK_CUR)
    elif vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", _read(f, 12))
        if etype == _ARRAY:  # as the C reader: arrays of arrays are not GGUF we read
            raise ValueError("GGUF metadata array of arrays")
        if etype in _FIXED:
            f.seek(_FIXED[etype] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")
