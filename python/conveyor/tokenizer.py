"""Tokenizers: one small interface over HF `tokenizers` files and llama2.c vocabularies.

    tok = load_tokenizer("path/to/model")          # HF folder or llama2.c .bin
    ids = tok.encode("Once upon a time")           # BOS included by default
    text = tok.decode(ids)                         # special tokens skipped by default
    raw = tok.all_token_bytes()                    # bytes of every id, for the C engine

Raw token bytes are what the engine detokenizes and matches stop strings on:
for ids that do not directly follow BOS, ``b"".join(tok.token_bytes(i) for i in ids)``
decoded as UTF-8 equals ``tok.decode(ids)`` for normal text. Special tokens have their
content as bytes for HF tokenizers (the caller drops the ids in ``special_ids`` when
skipping them) and empty bytes for llama2.c's <unk>, <s>, </s>.

When ``strip_leading_space_after_bos`` is true, decoding drops one leading space from the
token that directly follows BOS (llama2.c; SentencePiece-style HF tokenizers that add a
dummy prefix); the engine applies the same rule when generated text follows a bare BOS.

Chat templates: a tokenizer's chat template (HF tokenizer_config.json, or
``tokenizer.chat_template`` in a GGUF file) is rendered with jinja2 (sandboxed, as HF
does). A model without a template gets a plain built-in format, with a warning the first
time: one ``"{role}: {content}\\n"`` line per message, then ``"assistant: "`` when
``add_generation_prompt`` is true.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

from ._core import ModelFormatError
from .chat_template import render_chat_template as _render_template  # noqa: F401 (tests and tools use it)
from .gguf_tokenizer import (GGUF_METADATA_ARRAY_LIMIT, GGUF_PRE_TOKENIZERS,  # noqa: F401
                             MERGE_MAX_TOKEN_CHARS, GGUFTokenizer)
from .hf_tokenizer import HFTokenizer, _bytes_to_unicode  # noqa: F401
from .llama2c_tokenizer import Llama2cTokenizer
from .tokenizer_base import Tokenizer, render_default_chat  # noqa: F401

__all__ = [
    "Tokenizer",
    "Llama2cTokenizer",
    "HFTokenizer",
    "GGUFTokenizer",
    "GGUF_PRE_TOKENIZERS",
    "load_tokenizer",
    "render_default_chat",
]


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ---------------------------------------------------------------------------- loading


def _llama2c_vocab_size(model_file: Path) -> int:
    with open(model_file, "rb") as f:
        head = f.read(28)
    if len(head) < 28:
        raise ModelFormatError(f"{model_file}: too short for a llama2.c header ({len(head)} bytes)")
    vocab = struct.unpack("<7i", head)[5]
    if vocab == 0:
        raise ModelFormatError(f"{model_file}: vocab_size is 0")
    return abs(vocab)


def _find_llama2c_tokenizer(model_file: Path) -> Path:
    folder = model_file.parent
    first = folder / "tokenizer.bin"
    if first.is_file():
        return first
    found = sorted(p for p in folder.glob("tok*.bin") if p.is_file() and p != model_file)
    if found:
        return found[0]
    raise FileNotFoundError(
        f"no llama2.c tokenizer beside {model_file}: looked for {first} and {folder}/tok*.bin")


def load_tokenizer(model_path, tokenizer=None) -> Tokenizer:
    """Loads the tokenizer of a model.

    ``model_path``: a HF folder (tokenizer.json [+ tokenizer_config.json]), a .gguf file
    (the tokenizer in its metadata) or a llama2.c .bin (tokenizer.bin, else the first
    tok*.bin, from the same folder).
    ``tokenizer``: a Tokenizer (returned as is) or a path overriding the one found: a
    folder or tokenizer.json for HF, a .bin for llama2.c.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    model_path = Path(os.fspath(model_path))
    if not model_path.exists():
        raise FileNotFoundError(f"model not found: {model_path}")
    gguf = model_path.is_file() and _is_gguf(model_path)
    if gguf and tokenizer is None:
        return GGUFTokenizer.from_file(model_path)
    vocab_size = _llama2c_vocab_size(model_path) if model_path.is_file() and not gguf else None

    if tokenizer is not None:
        tpath = Path(os.fspath(tokenizer))
        if not tpath.exists():
            raise FileNotFoundError(f"tokenizer not found: {tpath}")
        if tpath.is_dir():
            return HFTokenizer(tpath / "tokenizer.json", tpath)
        if tpath.suffix == ".json":
            return HFTokenizer(tpath, tpath.parent)
        return Llama2cTokenizer(tpath, vocab_size)

    if model_path.is_dir():
        return HFTokenizer(model_path / "tokenizer.json", model_path)
    return Llama2cTokenizer(_find_llama2c_tokenizer(model_path), vocab_size)
