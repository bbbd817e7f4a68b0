"""Guided (structured) decoding: output constrained by a JSON schema, a regex,
a list of choices or a grammar, with vLLM's names.

    SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "object", ...}))

The grammar engine is llguidance (MIT; a Rust wheel with no torch dependency):
it turns a grammar into a per-token bitmask quickly enough to run every step,
and it is what vLLM, SGLang and llama.cpp use. (xgrammar needs torch;
outlines-core compiles each schema's index up front, which is slow for large
schemas.) Each constrained completion gets an LLMatcher; after each sampled
token the matcher advances and computes the next step's mask, which goes to
the C engine (cv_engine_set_token_mask). The C sampler sets the logits of
disallowed tokens to -inf; EOS is allowed only where the grammar accepts.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

__all__ = ["GuidedDecodingParams", "GuidedDecoder"]


def _error(message: str, field: str = "guided_decoding") -> ValueError:
    e = ValueError(message)
    e.field = field
    return e


def _first_line(text: str) -> str:
    """llguidance's errors carry the parser state after the first line."""
    return (text or "").strip().split("\n", 1)[0][:500]


# guided_choice entries: each becomes an alternative of one grammar rule, built and
# searched per token; 20,000 took seconds to build.
MAX_CHOICES = 1024


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency, but say what is missing
        raise _error("guided decoding needs the llguidance package (pip install llguidance)") from None
    return llguidance


def _gbnf_to_lark(llg):
    """llguidance's GBNF -> Lark converter: a function of the package in some
    releases, the function of a submodule of that name in others (1.9)."""
    conv = getattr(llg, "gbnf_to_lark", None)
    if conv is not None and not callable(conv):
        conv = getattr(conv, "gbnf_to_lark", None)
    if conv is None:
        import importlib

        conv = importlib.import_module("llguidance.gbnf_to_lark").gbnf_to_lark
    return conv


# A GBNF rule starts a line with its name and ::=; Lark's rules use ':', so a Lark grammar
# that only holds "::=" inside a string literal stays Lark.
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w-]*[ \t]*::=", re.MULTILINE)


@dataclass
class GuidedDecodingParams:
    """Exactly one of: json (a JSON schema, dict or str), regex, choice (list of
    str), grammar (Lark, or GBNF when a line starts a ``name ::=`` rule), json_object=True (any
    JSON object). The grammar is checked when the params are built: a bad one
    raises ValueError with ``.field == "guided_decoding"``."""

    json: Optional[Union[dict, str]] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self):
        self._grammar = self._compile()

    @classmethod
    def from_dict(cls, d: dict) -> "GuidedDecodingParams":
        if not isinstance(d, dict):
            raise _error(f"guided_decoding must be a GuidedDecodingParams or a dict, got {type(d).__name__}")
        unknown = set(d) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise _error(f"guided_decoding: unknown key(s) {sorted(unknown)}")
        return cls(**d)

    @property
    def lark_or_json_grammar(self) -> str:
        """The llguidance grammar (checked)."""
        return self._grammar

    def _compile(self) -> str:
        llg = _llguidance()
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise _error("guided_decoding needs exactly one of json, regex, choice, grammar, json_object; "
                         f"got {set_ or 'none'}")
        kind = set_[0]
        M = llg.LLMatcher
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise _error(f"guided_decoding.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _error(f"guided_decoding.json must be a JSON schema object, got {type(schema).__name__}")
            if schema is False:
                raise _error("guided_decoding.json is the schema false, which no output satisfies")
            try:
                g = M.grammar_from_json_schema(schema if isinstance(schema, dict) else {},
                                               defaults={"whitespace_flexible": False})
            except (ValueError, TypeError) as e:
                raise _error(f"guided_decoding.json: {e}") from None
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise _error("guided_decoding.regex must be a non-empty str")
            g = M.grammar_from_regex(self.regex)
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, str) and x for x in c):
                raise _error("guided_decoding.choice must be a non-empty list of non-empty str")
            if len(c) > MAX_CHOICES:
                raise _error(f"guided_decoding.choice has {len(c)} entries; at most {MAX_CHOICES} are allowed")
            # Lark string literals take JSON's escapes.
            g = M.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in c))
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise _error("guided_decoding.grammar must be a non-empty str (Lark or GBNF)")
            text = self.grammar
            if _GBNF_RULE.search(text):
                try:
                    text = _gbnf_to_lark(llg)(text)
                except Exception as e:  # the converter raises its own error classes
                    raise _error(f"guided_decoding.grammar: cannot read the GBNF grammar: {e}") from None
            g = M.grammar_from_lark(text)
        problem = M.validate_grammar(g)
        if problem and not problem.startswith("WARNING"):
            raise _error(f"guided_decoding.{kind}: {problem.strip()}")
        return g


def coerce_guided(value) -> Optional[GuidedDecodingParams]:
    """None, a GuidedDecodingParams, or a dict of its fields."""
    if value is None or isinstance(value, GuidedDecodingParams):
        return value
    return GuidedDecodingParams.from_dict(value)


class _ByteVocab:
    """What llguidance's TokenizerWrapper reads: every token's raw bytes (as the
    engine detokenizes them), EOS/BOS, the special ids and an exact encoder."""

    def __init__(self, tok, n_vocab: int):
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = tok.all_token_bytes(n_vocab)
        self.special_token_ids = sorted(set(tok.special_ids) | set(range(tok.vocab_size, n_vocab)))
        self._tok = tok

    def __call__(self, text) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return self._tok.encode_exact_bytes(data)


class GuidedDecoder:
    """An llguidance tokenizer for one engine's vocabulary, and the matchers
    and masks of its constrained completions."""

    def __init__(self, tokenizer, vocab_size: int):
        llg = _llguidance()
        if tokenizer is None:
            raise _error("guided decoding needs a tokenizer (skip_tokenizer_init=True was given)")
        eos = tokenizer.eos_id
        if tokenizer.kind == "hf" and getattr(tokenizer, "path", None) is not None:
            # HF: llguidance reads the tokenizer.json itself (its pre-tokenizer included).
            self.lltok = llg.LLTokenizer(tokenizer.path.read_text(encoding="utf-8"), n_vocab=vocab_size,
                                         eos_token=eos)
        else:
            # llama2.c / others: the raw token bytes conveyor's tokenizer exposes.
            self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)),
                                         n_vocab=vocab_size)
        self.words = (vocab_size + 31) // 32
        self._llg = llg

    def matcher(self, params: GuidedDecodingParams):
        m = self._llg.LLMatcher(self.lltok, params.lark_or_json_grammar, log_level=0)
        if m.is_error():
            raise _error(f"guided_decoding: {_first_line(m.get_error())}")
        return m

    def start(self, params: GuidedDecodingParams, n: int):
        """(n matchers, the first token's mask): one grammar built and its first mask
        computed (where a grammar past the grammar engine's limits usually fails:
        ValueError, field "guided_decoding"), then copied for the other completions."""
        m = self.matcher(params)
        mask = self.mask(m)
        if mask is None:
            raise _error("guided_decoding: the grammar engine gave up on this grammar at the first token: "
                         f"{_first_line(m.get_error())}")
        return [m] + [m.deep_copy() for _ in range(n - 1)], mask

    @staticmethod
    def error_of(matcher, index: int, pos: int) -> str:
        """Why matcher failed, for the client: the grammar engine's first line."""
        return (f"guided_decoding: the grammar engine gave up on completion {index} after {pos} tokens: "
                f"{_first_line(matcher.get_error()) or 'the sampled token was not allowed'}")

    def mask(self, matcher) -> Optional[np.ndarray]:
        """The next token's allowed-token bitmask, or None when the matcher failed."""
        if matcher.is_error():
            return None
        out = np.zeros(self.words, dtype=np.uint32)
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)  # releases the GIL
        return None if matcher.is_error() else out
