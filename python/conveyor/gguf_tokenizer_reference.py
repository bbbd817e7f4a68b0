"""The tests' reference for the GGUF tokenizer: a "llama" (SentencePiece-style) vocabulary
as the BPE that HF `tokenizers` runs with the merges its scores give.

    hf = build_hf_tokenizer(metadata)     # a tokenizers.Tokenizer
    hf.encode(text).ids                   # what GGUFTokenizer(metadata).encode(text) must give

The merges (``score_merges``): every split (a, b) of a token t with a and b in the
vocabulary, best score first, as SentencePiece joins the best-scoring pair. GGUFTokenizer
encodes straight from the tables in C and builds no such list; deriving it costs memory per
merge, so it is capped by a budget proportional to the size of the tokenizer's arrays in
the file (``merge_budget``): past it, a ModelFormatError naming the count and the budget,
before the merges are built. The list comes from a hook of conveyor._testing, so this
module is for tests and tools, never the product.
"""
from __future__ import annotations

import os

from . import _testing
from ._core import ModelFormatError
from .gguf_tokenizer import (_TT_NORMAL, MERGE_MAX_TOKEN_CHARS, _add_whole_tokens, _build_bpe, _meta_list,
                             _spm_tables)

__all__ = ["build_hf_tokenizer", "score_merges", "merge_budget", "MERGE_BUDGET_BYTES", "MAX_MERGES"]

# The merge list may hold at most one merge per MERGE_BUDGET_BYTES bytes of the tokenizer's
# arrays (each token's text, its 8-byte length, 4-byte score and 4-byte type), and never more
# than MAX_MERGES: real vocabularies need far fewer (Gemma 3: 514,847 merges from 6.5 MB, one
# per 12.6 bytes), while a crafted vocabulary in which every split of every token is a token
# would turn a 2 MB file into millions of merges.
MERGE_BUDGET_BYTES = 4
MAX_MERGES = 4_000_000


def merge_budget(tokens: list[str]) -> int:
    """The most merges the scores of ``tokens`` may give (see MERGE_BUDGET_BYTES); the
    characters of the tokens stand in for their bytes (never more)."""
    return min(MAX_MERGES, _arrays_bytes(tokens) // MERGE_BUDGET_BYTES)


def _arrays_bytes(tokens: list[str]) -> int:
    return sum(map(len, tokens)) + 16 * len(tokens)


def score_merges(tokens: list[str], scores: list, types: list[int] | None) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first bigram merging: every
    split (a, b) of a token t with a and b in the vocabulary, ordered by t's score (best
    first), then by the ids of t, a, b. More than merge_budget(tokens) merges is a
    ModelFormatError."""
    budget = merge_budget(tokens)
    try:
        return _testing.gguf_score_merges(tokens, scores, types, max_token_chars=MERGE_MAX_TOKEN_CHARS,
                                          max_merges=budget, seed=int.from_bytes(os.urandom(8), "little"))
    except ModelFormatError as e:
        if "merges" not in str(e):
            raise
        raise ModelFormatError(
            f"{e}: the budget of a tokenizer whose arrays hold {_arrays_bytes(tokens)} bytes "
            f"({len(tokens)} tokens) is one merge per {MERGE_BUDGET_BYTES} bytes, at most {MAX_MERGES}; "
            f"splits of its tokens into two tokens give more") from None


def build_hf_tokenizer(metadata: dict):
    """GGUF tokenizer metadata as a HF `tokenizers` Tokenizer: for "llama" vocabularies the
    BPE with the merges their scores give (within merge_budget), which GGUFTokenizer's C
    encoder matches id for id; for "gpt2" ones the tokenizer GGUFTokenizer itself runs."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = _meta_list(metadata, "tokenizer.ggml.tokens", str)
    types = _meta_list(metadata, "tokenizer.ggml.token_type", int, required=False) or [_TT_NORMAL] * len(tokens)
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))  # a text's first id
    if metadata.get("tokenizer.ggml.model") != "llama":
        return _build_bpe(metadata, tokens, types, vocab)
    scores, prefix, unk = _spm_tables(metadata, tokens)
    merges = score_merges(tokens, scores, types)
    bpe = models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk], fuse_unk=True,
                     byte_fallback=True, ignore_merges=False)
    del merges
    tok = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", "\u2581")]
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
        dec.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(dec)
    _add_whole_tokens(tok, tokens, types)
    return tok
