"""The tokenizer stored in a GGUF file's metadata, built fast and within a budget.

    tok = GGUFTokenizer.from_file("model.gguf")     # or GGUFTokenizer(metadata_dict)

``tokenizer.ggml.model`` "gpt2": byte-level BPE (tokens, merges) with the pre-tokenizer
named by ``tokenizer.ggml.pre`` (see GGUF_PRE_TOKENIZERS), run by HF `tokenizers`;
"llama": SentencePiece-style (tokens, scores; "▁" for spaces, <0xNN> byte-fallback
tokens, dummy prefix unless ``add_space_prefix`` is false), run by a C encoder
(``_core.SpmTokenizer``) straight from the tables, as llama.cpp does: no merge list is
built, so a 262k vocabulary loads in a few hundredths of a second. Control, unknown and
user-defined tokens are matched whole in the text, never split.

The ids are those of the BPE that HF `tokenizers` runs with the merges equivalent to the
scores: every split of a token into two tokens, best score first
(conveyor.gguf_tokenizer_reference builds that BPE, the tests' reference).
The gpt2 `tokenizers` object is assembled through its Python API (no tokenizer.json text
to write and parse); the per-id tables (bytes of every token, special ids) come straight
from the token list.
"""
from __future__ import annotations

import gc
import os
import re
from pathlib import Path

from ._core import ModelFormatError, UnsupportedError
from .hf_tokenizer import _BYTELEVEL_TO_LATIN1, HFTokenizer
from .tokenizer_base import _check_ids, _check_text

__all__ = ["GGUFTokenizer", "GGUF_PRE_TOKENIZERS"]

# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` name, as llama.cpp applies them: each
# regex in turn splits every piece into its matches and the text between them.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
                 r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
                r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2_REGEX],
    "smollm": [r"\p{N}", _GPT2_REGEX],
    "starcoder": [r"\p{N}", _GPT2_REGEX],
    "llama-bpe": [_LLAMA3_REGEX],
    "llama3": [_LLAMA3_REGEX],
    "qwen2": [_QWEN2_REGEX],
    "qwen2.5": [_QWEN2_REGEX],
}
# Llama 3 vocabularies: a word that is itself a token is taken whole (merges not applied),
# and BOS is added unless the file says otherwise (llama.cpp's behaviour for them).
_LLAMA3_PRE = {"llama-bpe", "llama3"}
# tokenizer.ggml.token_type values
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6
# token types matched whole in the text and whose bytes are their text as written
_TT_WHOLE = (_TT_UNKNOWN, _TT_CONTROL, _TT_USER)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Merges from scores: only tokens of 2..MERGE_MAX_TOKEN_CHARS characters are split into
# merges (SentencePiece's own pieces are at most 16 by default); a longer token is never
# the result of a merge (still matched whole when it is a control or user-defined token).
# The C encoder and the reference's merge list follow the same rule.
MERGE_MAX_TOKEN_CHARS = 128
# gguf_metadata(array_limit=...): other arrays longer than this are not read into lists.
GGUF_METADATA_ARRAY_LIMIT = 1 << 16


def _meta_list(md: dict, key: str, kind, required: bool = True) -> list | None:
    v = md.get(key)
    if v is None:
        if required:
            raise ModelFormatError(f"GGUF tokenizer: metadata {key} is missing")
        return None
    # the element types checked once each (a 262k vocabulary has one or two)
    if not isinstance(v, (list, tuple)) or not all(issubclass(t, kind) for t in set(map(type, v))):
        raise ModelFormatError(f"GGUF tokenizer: metadata {key} must be a list of {kind}")
    return list(v)


def _meta_id(md: dict, key: str, n: int) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise ModelFormatError(f"GGUF tokenizer: {key} = {v!r} is not a token id below {n}")
    return v


def _split_merges(lines: list[str]) -> list[tuple[str, str]]:
    """GGUF BPE merges ("left right"; the left part may begin with a space) as pairs."""
    merges = []
    for m in lines:
        cut = m.find(" ", 1)
        if cut < 0:
            raise ModelFormatError(f"GGUF tokenizer: merge {m!r} has no space")
        merges.append((m[:cut], m[cut + 1:]))
    return merges


def _spm_tables(md: dict, tokens: list[str]) -> tuple[list, bool, int | None]:
    """A "llama" vocabulary's scores, whether it adds a leading space (SentencePiece dummy
    prefix) and its unknown token's id."""
    scores = _meta_list(md, "tokenizer.ggml.scores", (int, float))
    if len(scores) != len(tokens):
        raise ModelFormatError(f"GGUF tokenizer: {len(scores)} scores for {len(tokens)} tokens")
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    return scores, prefix, _meta_id(md, "tokenizer.ggml.unknown_token_id", len(tokens))


def _build_bpe(md: dict, tokens: list[str], types: list[int], vocab: dict[str, int]):
    """The `tokenizers` object of a "gpt2" GGUF tokenizer: its merges, its pre-tokenizer
    and its whole-matched tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedError(f"GGUF tokenizer model {model!r} is not supported (gpt2, llama)")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise UnsupportedError(f"GGUF tokenizer: pre-tokenizer {pre!r} is not supported; "
                               f"supported: {', '.join(GGUF_PRE_TOKENIZERS)}")
    merges = _split_merges(_meta_list(md, "tokenizer.ggml.merges", str))
    try:  # a merge naming a token the vocabulary lacks is refused by `tokenizers` itself
        bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRE)
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        raise ModelFormatError(f"GGUF tokenizer: tokenizer.ggml.merges: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), "isolated", invert=False) for r in GGUF_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_whole_tokens(tok, tokens, types)
    return tok


def _add_whole_tokens(tok, tokens: list[str], types: list[int]) -> None:
    """Control, unknown and user-defined tokens added to `tokenizers` object tok, matched
    whole in the raw text."""
    from tokenizers import AddedToken

    added = [i for i, t in enumerate(types) if t in _TT_WHOLE]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False) for i in added if types[i] != _TT_USER])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in added if types[i] == _TT_USER])


def _token_bytes(tokens: list[str], types: list[int], vocab: dict[str, int], style: str) -> list[bytes]:
    """The raw bytes of every id: user-defined, control and unknown tokens as their text;
    byte-level symbols as their bytes; "▁" as a space and <0xNN> as its byte
    (SentencePiece); b"" for an id whose text an earlier id already has."""
    if style == "bytelevel":
        out = []
        for t in tokens:
            try:
                out.append(t.translate(_BYTELEVEL_TO_LATIN1).encode("latin-1"))
            except UnicodeEncodeError:  # not all byte-level symbols
                out.append(t.encode("utf-8"))
    else:
        out = [t.replace("\u2581", " ").encode("utf-8") for t in tokens]
        for i in [i for i, t in enumerate(tokens) if t.startswith("<0x")]:
            if m := _BYTE_PIECE.fullmatch(tokens[i]):
                out[i] = bytes([int(m.group(1), 16)])
    for i in [i for i, ty in enumerate(types) if ty in _TT_WHOLE]:
        out[i] = tokens[i].encode("utf-8")
    if len(vocab) < len(tokens):
        for i, t in enumerate(tokens):
            if vocab[t] != i:
                out[i] = b""
    return out


def _hf_byte(piece: str) -> int | None:
    """The byte of a <0xNN> piece as HF's ByteFallback decoder reads it, else None."""
    raw = piece.encode("utf-8")
    if len(raw) != 6 or not raw.startswith(b"<0x") or not raw.endswith(b">"):
        return None
    return int(raw[3:5], 16) if re.fullmatch(rb"\+?[0-9A-Fa-f]+", raw[3:5]) else None


def _decode_run(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


class GGUFTokenizer(HFTokenizer):
    """The tokenizer of a GGUF file (see the module's docstring). ``metadata`` is a plain
    dict (from conveyor.gguf.GGUFReader or the C reader's ``Checkpoint.metadata``; arrays
    as lists)."""

    kind = "gguf"

    def __init__(self, metadata: dict):
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
        md = metadata
        if "tokenizer.ggml.model" not in md:
            raise ModelFormatError("GGUF file has no tokenizer (metadata tokenizer.ggml.model is missing)")
        tokens = _meta_list(md, "tokenizer.ggml.tokens", str)
        if not tokens:
            raise ModelFormatError("GGUF tokenizer: tokenizer.ggml.tokens is empty")
        types = _meta_list(md, "tokenizer.ggml.token_type", int, required=False) or [_TT_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFormatError(f"GGUF tokenizer: {len(types)} token types for {len(tokens)} tokens")
        n = len(tokens)
        bos = _meta_id(md, "tokenizer.ggml.bos_token_id", n)
        eos = _meta_id(md, "tokenizer.ggml.eos_token_id", n)
        eot = _meta_id(md, "tokenizer.ggml.eot_token_id", n)
        self.pad_id = _meta_id(md, "tokenizer.ggml.padding_token_id", n)
        self.unk_id = _meta_id(md, "tokenizer.ggml.unknown_token_id", n)
        # hundreds of thousands of tuples and strings, none in a cycle: no collections
        collecting = gc.isenabled()
        gc.disable()
        try:
            vocab = dict(zip(reversed(tokens), range(n - 1, -1, -1)))  # a text's first id
            self.model = md["tokenizer.ggml.model"]
            if self.model == "llama":
                self._tok, prefix = None, self._build_spm(md, tokens, types)
            else:
                self._spm = None
                self._tok, prefix = _build_bpe(md, tokens, types, vocab), False
            self.path = None
            self.pre = md.get("tokenizer.ggml.pre")
            self.style = "bytelevel" if self.model == "gpt2" else "metaspace"
            self.byte_fallback = self.model == "llama"
            self.strip_leading_space_after_bos = prefix
            self.vocab_size = max(max(vocab.values()) + 1, len(vocab))
            self._bytes = _token_bytes(tokens, types, vocab, self.style)[:self.vocab_size]
            self._tokens = tokens
            self._dup_ids = {i for i, t in enumerate(tokens) if vocab[t] != i} if len(vocab) < n else set()
        finally:
            if collecting:
                gc.enable()

        self.bos_id = None if bos is None else vocab[tokens[bos]]
        self.bos_token = None if bos is None else tokens[bos]
        self.eos_token = None if eos is None else tokens[eos]
        eos_ids: list[int] = []
        for i in (None if eos is None else vocab[tokens[eos]], eos, eot):
            if i is not None and i not in eos_ids:
                eos_ids.append(i)
        self.eos_ids = eos_ids
        self.eos_id = eos_ids[0] if eos_ids else None
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = tokens[self.eos_id]
        self.special_ids = {i for i, t in enumerate(types) if t in (_TT_CONTROL, _TT_UNKNOWN)}
        self.special_ids.update(i for i in (self.bos_id, *eos_ids) if i is not None)
        # llama.cpp's defaults: SentencePiece and Llama 3 vocabularies add BOS, other BPE ones do not
        self.add_bos_token = bool(md.get("tokenizer.ggml.add_bos_token",
                                         self.model == "llama" or self.pre in _LLAMA3_PRE))
        self.add_eos_token = bool(md.get("tokenizer.ggml.add_eos_token", False))
        tmpl = md.get("tokenizer.chat_template")
        self.chat_template = tmpl if isinstance(tmpl, str) and tmpl else None

    def _build_spm(self, md: dict, tokens: list[str], types: list[int]) -> bool:
        """The C encoder of a "llama" vocabulary; whether it adds a leading space."""
        from . import _core

        scores, prefix, unk = _spm_tables(md, tokens)
        self._spm = _core.SpmTokenizer(tokens, scores, types, unk_id=-1 if unk is None else unk,
                                       add_space_prefix=prefix, max_token_chars=MERGE_MAX_TOKEN_CHARS,
                                       seed=int.from_bytes(os.urandom(8), "little"))
        return prefix

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._spm is None:
            return super().encode(text, add_special_tokens)
        ids = self._spm.encode(_check_text(text))
        return self._with_bos_eos(ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """As HF `tokenizers` decodes a SentencePiece vocabulary: "▁" as a space, runs of
        <0xNN> pieces as their bytes (U+FFFD for each byte of a run that is not UTF-8),
        then one leading space dropped when a dummy prefix is added."""
        if self._spm is None:
            return super().decode(ids, skip_special_tokens)
        ids = [i for i in _check_ids(ids) if i < self.vocab_size and i not in self._dup_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        out: list[str] = []
        run = bytearray()
        for i in ids:
            piece = self._tokens[i].replace("\u2581", " ")
            b = _hf_byte(piece) if piece.startswith("<0x") else None
            if b is not None:
                run.append(b)
                continue
            if run:
                out.append(_decode_run(run))
                run.clear()
            out.append(piece)
        if run:
            out.append(_decode_run(run))
        text = "".join(out)
        return text[1:] if self.strip_leading_space_after_bos and text.startswith(" ") else text

    def id_to_piece(self, token_id: int) -> str | None:
        if self._spm is None:
            return super().id_to_piece(token_id)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            return None
        return None if token_id in self._dup_ids else self._tokens[token_id]

    @classmethod
    def from_file(cls, path) -> "GGUFTokenizer":
        from . import _core

        # the C reader (conveyor.gguf, the Python one, is the tests' independent reference)
        # arrays the tokenizer does not read are left out when long (their lists cost ~10x the file)
        tok = cls(_core.gguf_metadata(os.fspath(path), array_limit=GGUF_METADATA_ARRAY_LIMIT))
        tok.path = Path(os.fspath(path))
        return tok
