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

import functools
import heapq
import json
import os
import re
import struct
from pathlib import Path
from typing import Iterable, Sequence
import warnings

from ._core import ModelFormatError

__all__ = [
    "Tokenizer",
    "Llama2cTokenizer",
    "HFTokenizer",
    "GGUFTokenizer",
    "GGUF_PRE_TOKENIZERS",
    "load_tokenizer",
    "render_default_chat",
]

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def render_default_chat(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The built-in chat format: "{role}: {content}\\n" per message, then "assistant: "."""
    out = [f"{m['role']}: {m['content']}\n" for m in messages]
    if add_generation_prompt:
        out.append("assistant: ")
    return "".join(out)


# The largest value (characters, items, or bits of an integer / 8) a chat template's
# operator or string method may build: far above what real templates make (about the
# messages' size), far below what would exhaust memory in one C call.
CHAT_TEMPLATE_MAX_VALUE = 1 << 24
_PERCENT_SPEC = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill"}


def _too_big(what: str, size) -> ValueError:
    return ValueError(f"chat template: {what} would make a value of {size} items, over the "
                      f"limit of {CHAT_TEMPLATE_MAX_VALUE}")


def _check_binop(op: str, left, right) -> None:
    """Refuses `seq * n`, `a ** b` and `'%Nd' % x` that would build a huge value."""
    seq = (str, bytes, list, tuple)
    if op == "*":
        for a, b in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(b, int) and len(a) * max(b, 0) > CHAT_TEMPLATE_MAX_VALUE:
                raise _too_big("'*'", len(a) * b)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        bits = right * abs(left).bit_length()
        if bits > 8 * CHAT_TEMPLATE_MAX_VALUE // 64:  # a 256 KiB integer is already absurd here
            raise _too_big("'**'", bits // 8)
    elif op == "%" and isinstance(left, str):
        for m in _PERCENT_SPEC.finditer(left):
            for n in m.groups():
                if n == "*" or (n is not None and int(n) > CHAT_TEMPLATE_MAX_VALUE):
                    raise ValueError("chat template: a '%' format width or precision that is '*' or over "
                                     f"{CHAT_TEMPLATE_MAX_VALUE}")


def _check_call(obj, args) -> None:
    """Refuses str methods whose width or replacement would build a huge string."""
    name = getattr(obj, "__name__", None)
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in _WIDTH_METHODS and args and isinstance(args[0], int) and args[0] > CHAT_TEMPLATE_MAX_VALUE:
        raise _too_big(f"str.{name}", args[0])
    if name == "expandtabs" and args and isinstance(args[0], int) and args[0] * owner.count("\t") > \
            CHAT_TEMPLATE_MAX_VALUE:
        raise _too_big("str.expandtabs", args[0] * owner.count("\t"))
    if name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])


def _check_replace(s, old, new) -> None:
    s, old, new = str(s), str(old), str(new)
    if len(new) > len(old):
        n = s.count(old) if old else len(s) + 1
        if len(s) + n * (len(new) - len(old)) > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("replace", len(s) + n * (len(new) - len(old)))


@functools.lru_cache(maxsize=1)
def _template_environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the operators and string methods that turn small literals
        into huge values checked first. Intercepted operators are also not folded at
        compile time: jinja's optimizer would otherwise build `{{ 'ab' * 10**9 }}` while
        compiling, outside every render cap (24 s and 7.6 GB, found by the fuzzer)."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _check_call(__obj, args)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedEnvironment


def _bounded_filters(env) -> None:
    """The same checks for the filters that pad or replace (they bypass call())."""
    from jinja2.filters import pass_eval_context

    replace, center, indent = env.filters["replace"], env.filters["center"], env.filters["indent"]

    @pass_eval_context
    def bounded_replace(eval_ctx, s, old, new, count=None):
        if count is None:
            _check_replace(s, old, new)
        return replace(eval_ctx, s, old, new, count)

    def bounded_center(value, width=80):
        if isinstance(width, int) and width > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("center", width)
        return center(value, width)

    def bounded_indent(s, width=4, *args, **kwargs):
        w = len(width) if isinstance(width, str) else width
        if isinstance(w, int) and w * (str(s).count("\n") + 1) > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("indent", w * (str(s).count("\n") + 1))
        return indent(s, width, *args, **kwargs)

    env.filters.update(replace=bounded_replace, center=bounded_center, indent=bounded_indent)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = _template_environment_class()(trim_blocks=True, lstrip_blocks=True)
    _bounded_filters(env)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelFormatError(f"the model's chat template is not valid Jinja: {e}") from None
    except (RecursionError, MemoryError, OverflowError) as e:  # nesting past the parser's depth, ...
        raise ModelFormatError(f"the model's chat template cannot be compiled: {type(e).__name__}") from None


# A chat template is code from the model file (or the request) run on every chat
# request: the sandbox keeps it from the host, these caps keep it from the CPU and
# memory. Real templates render a conversation in well under a millisecond, and their
# output is about the size of the messages.
CHAT_TEMPLATE_MAX_SECONDS = 2.0
CHAT_TEMPLATE_MAX_OUTPUT = 1 << 20  # characters beyond the messages' own


def _render_template(source: str, messages: list[dict], add_generation_prompt: bool,
                     bos_token: str, eos_token: str) -> str:
    from .deadline import call_with_deadline

    limit = CHAT_TEMPLATE_MAX_OUTPUT + sum(len(m["content"]) for m in messages)
    template = _compile_template(source)  # a template that does not compile: ModelFormatError

    def render():
        parts, size = [], 0
        for piece in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token):
            size += len(piece)
            if size > limit:
                raise ValueError(f"chat template output is over {limit} characters")
            parts.append(piece)
        return "".join(parts)

    try:
        return call_with_deadline(CHAT_TEMPLATE_MAX_SECONDS, "rendering the chat template", render)
    except ValueError as e:  # raise_exception() in the template, or the output cap
        raise ValueError(f"chat template failed to render: {e}") from None
    except MemoryError:  # past the renderer's memory cap (conveyor.template_pool)
        raise ValueError("chat template failed to render: it needs more memory than a template may "
                         "use (MemoryError)") from None
    except Exception as e:  # jinja's own errors, and OverflowError, RecursionError, TimeoutError...
        raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from None


def _check_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise TypeError("messages must be a list of {'role': str, 'content': str} dicts")
    msgs = list(messages)
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r}")
            if not isinstance(m[key], str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {type(m[key]).__name__}")
    return msgs


def _check_ids(ids) -> list[int]:
    if isinstance(ids, (str, bytes)):
        raise TypeError("token ids must be a sequence of ints")
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise TypeError(f"token id must be an int, got {type(i).__name__}")
        i = i.__index__()
        if i < 0:
            raise ValueError(f"token id {i} is negative")
        out.append(i)
    return out


class Tokenizer:
    """The interface shared by both kinds of tokenizer.

    Attributes: ``kind`` ("hf" or "llama2c"), ``vocab_size``, ``bos_id`` (or None),
    ``eos_id`` (or None), ``eos_ids`` (all ids that end generation), ``special_ids``,
    ``strip_leading_space_after_bos``, ``chat_template`` (or None).
    """

    kind: str = ""
    vocab_size: int = 0
    bos_id: int | None = None
    eos_id: int | None = None
    eos_ids: list[int]
    special_ids: set[int]
    strip_leading_space_after_bos: bool = False
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def encode_exact_bytes(self, data: bytes) -> list[int]:
        """Ids whose token bytes concatenate to exactly ``data``: no BOS, no dummy
        prefix (what a grammar engine needs to tokenize forced text). The
        tokenizer's own encoding when it is exact, else longest-match on bytes."""
        ids = self.encode(data.decode("utf-8", "replace"), add_special_tokens=False)
        if b"".join(self.token_bytes(i) for i in ids) == data:
            return ids
        return self._greedy_bytes(data)

    def _greedy_bytes(self, data: bytes) -> list[int]:
        table = getattr(self, "_bytes_table", None)
        if table is None:
            table = {}
            for i in range(self.vocab_size):
                b = self.token_bytes(i)
                if b and i not in self.special_ids:
                    table.setdefault(b, i)
            self._bytes_table = table
            self._bytes_max = max(map(len, table), default=1)
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._bytes_max, len(data) - at), 0, -1):
                i = table.get(data[at:at + n])
                if i is not None:
                    ids.append(i)
                    at += n
                    break
            else:
                raise ValueError(f"byte {data[at]:#04x} has no token in this vocabulary")
        return ids

    def all_token_bytes(self, size: int | None = None) -> list[bytes]:
        """Raw bytes of ids 0..n-1, n = max(vocab_size, size); ids past the vocabulary are b""."""
        n = self.vocab_size if size is None else max(self.vocab_size, int(size))
        return [self.token_bytes(i) if i < self.vocab_size else b"" for i in range(n)]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, *,
                            warn_without_template: bool = True) -> str:
        """The conversation as the model's prompt text: its chat template rendered with
        jinja2 (sandboxed, as HF does, in a worker process whose memory and CPU time are
        capped: conveyor.template_pool), or for a model without a template the built-in
        ``"{role}: {content}\\n"`` format, with a warning the first time (unless the
        caller gives its own: warn_without_template=False)."""
        msgs = _check_messages(messages)
        if not self.chat_template:
            if warn_without_template and not getattr(self, "_warned_no_template", False):
                self._warned_no_template = True
                warnings.warn(f"{self!r} has no chat template; using the built-in "
                              "'role: content' format, which the model was not trained on",
                              UserWarning, stacklevel=2)
            return render_default_chat(msgs, add_generation_prompt)
        from .template_pool import render_in_pool

        return render_in_pool(self.chat_template, msgs, add_generation_prompt, self.bos_token or "",
                              self.eos_token or "")

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} vocab_size={self.vocab_size} bos_id={self.bos_id} "
                f"eos_ids={self.eos_ids}>")


# ---------------------------------------------------------------------------- llama2.c


class Llama2cTokenizer(Tokenizer):
    """llama2.c's tokenizer.bin: int32 max_token_length, then per id {float32 score,
    int32 len, len bytes}. Ids 0 <unk>, 1 BOS, 2 EOS, 3..258 byte tokens <0x00>..<0xFF>.

    ``vocab_size`` comes from the model header; None reads records up to the end of file.
    """

    kind = "llama2c"

    def __init__(self, path, vocab_size: int | None = None):
        path = Path(path)
        data = path.read_bytes()  # FileNotFoundError names the path
        if len(data) < 4:
            raise ModelFormatError(f"{path}: tokenizer file is too short ({len(data)} bytes)")
        (max_len,) = struct.unpack_from("<i", data, 0)
        if max_len <= 0:
            raise ModelFormatError(f"{path}: max_token_length {max_len} is not positive")
        pieces: list[bytes] = []
        scores: list[float] = []
        off = 4
        while (vocab_size is None and off < len(data)) or (vocab_size is not None and len(pieces) < vocab_size):
            if off + 8 > len(data):
                raise ModelFormatError(
                    f"{path}: truncated at token {len(pieces)} (offset {off}, file {len(data)} bytes)")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise ModelFormatError(f"{path}: token {len(pieces)} has bad length {n} at offset {off - 4}")
            pieces.append(data[off:off + n])
            scores.append(score)
            off += n
        if len(pieces) < 259:
            raise ModelFormatError(
                f"{path}: {len(pieces)} tokens; a llama2.c vocabulary needs at least 259 "
                "(<unk>, <s>, </s> and 256 byte tokens)")
        self.path = path
        self.max_token_length = max_len
        self.pieces = pieces
        self.scores = scores
        self.vocab_size = len(pieces)
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            self._lookup.setdefault(p, i)
        self.bos_id, self.eos_id, self.unk_id = 1, 2, 0
        # llama2.c's models were trained with BOS delimiting stories, and its
        # reference sampler stops when BOS comes out; EOS still ends too.
        self.eos_ids = [2, 1]
        self.special_ids = {0, 1, 2}
        self.bos_token = pieces[1].decode("utf-8", "replace")
        self.eos_token = pieces[2].decode("utf-8", "replace")
        self.strip_leading_space_after_bos = True
        self.chat_template = None
        self._bytes = [self._raw(i) for i in range(self.vocab_size)]

    def _raw(self, i: int) -> bytes:
        if i in self.special_ids:
            return b""
        p = self.pieces[i]
        m = _BYTE_PIECE.fullmatch(p)
        return bytes([int(m.group(1), 16)]) if m else p

    def token_bytes(self, token_id: int) -> bytes:
        (i,) = _check_ids([token_id])
        return self._bytes[i] if i < self.vocab_size else b""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        if add_special_tokens:
            ids.append(self.bos_id)
        if text:
            ids.append(self._lookup.get(b" ", 0x20 + 3))  # dummy prefix
        for ch in text:
            b = ch.encode("utf-8")
            i = self._lookup.get(b)
            if i is None:
                ids.extend(x + 3 for x in b)  # byte fallback
            else:
                ids.append(i)
        return self._merge(ids)

    def encode_exact_bytes(self, data: bytes) -> list[int]:
        ids: list[int] = []
        for ch in data.decode("utf-8", "surrogateescape"):
            b = ch.encode("utf-8", "surrogateescape")
            i = self._lookup.get(b)
            if i is None:
                ids.extend(x + 3 for x in b)  # byte fallback
            else:
                ids.append(i)
        return self._merge(ids)

    def _merge(self, toks: list[int]) -> list[int]:
        """Repeatedly merges the adjacent pair with the best-scoring concatenation
        (leftmost on ties), as llama2.c does, using a heap instead of rescanning."""
        n = len(toks)
        if n < 2:
            return toks
        toks = list(toks)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        alive = [True] * n
        pieces, scores, lookup = self.pieces, self.scores, self._lookup
        heap: list[tuple] = []

        def push(i: int) -> None:
            j = nxt[i]
            if i < 0 or j < 0:
                return
            m = lookup.get(pieces[toks[i]] + pieces[toks[j]])
            if m is not None and scores[m] > -1e10:
                heapq.heappush(heap, (-scores[m], i, j, toks[i], toks[j], m))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, j, ti, tj, m = heapq.heappop(heap)
            if not alive[i] or nxt[i] != j or toks[i] != ti or toks[j] != tj:
                continue  # stale: one side merged since this pair was queued
            toks[i] = m
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prv[nxt[j]] = i
            push(prv[i])
            push(i)
        return [toks[i] for i in range(n) if alive[i]]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        prev = None
        for i in _check_ids(ids):
            if i >= self.vocab_size:
                prev = i
                continue
            if i in self.special_ids:
                if not skip_special_tokens:
                    out += self.pieces[i]
            else:
                piece = self.pieces[i]
                if prev == self.bos_id and piece.startswith(b" "):
                    out += piece[1:]
                else:
                    out += self._bytes[i]
            prev = i
        return out.decode("utf-8", "replace")

    def id_to_piece(self, token_id: int) -> str:
        return self.pieces[token_id].decode("utf-8", "replace")


# ---------------------------------------------------------------------------- HF


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
# str.translate table from byte-level symbols to the latin-1 char of their byte; any other
# char below 256 maps to one that latin-1 cannot encode, so such a token falls back to UTF-8
_BYTELEVEL_TO_LATIN1 = {**{i: 0x100 for i in range(256)}, **{ord(c): b for c, b in _UNICODE_TO_BYTE.items()}}


def _components(node) -> list[dict]:
    """Flattens a tokenizer.json normalizer/decoder/pre-tokenizer (possibly a Sequence)."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        out = []
        for key in ("decoders", "pretokenizers", "normalizers", "processors"):
            for sub in node.get(key) or []:
                out += _components(sub)
        return out
    return [node]


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# Size caps on the JSON files of a model folder, far above real ones (tokenizer.json:
# 33 MB for Gemma 3's 262k vocabulary; the others a few kB, chat templates included):
# a JSON file costs ~10x its size in Python objects.
MAX_TOKENIZER_JSON_BYTES = 128 << 20
MAX_SMALL_JSON_BYTES = 4 << 20  # tokenizer_config.json, config.json, generation_config.json
MAX_CHAT_TEMPLATE_BYTES = 1 << 20
# Token ids: at most this many ids past the number of entries (holes, reserved ids), so
# that one entry with id 200,000,000 cannot make the id tables gigabytes.
MAX_VOCAB_HOLES = 1 << 16


def _read_json(path: Path, limit: int = MAX_SMALL_JSON_BYTES) -> dict:
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise ModelFormatError(f"{path}: {size} bytes, more than the {limit} this file may have")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ModelFormatError(f"{path}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_model_text(folder: Path, name: str, limit: int) -> str:
    """A text file of the model folder, refused when a symlink takes it out of the folder
    (a model from elsewhere must not read the host's files into prompts). The Hugging
    Face cache's layout, snapshots/REV/NAME -> ../../blobs/HASH, stays allowed."""
    path = folder / name
    root = folder.resolve()
    if root.parent.name == "snapshots":
        root = root.parent.parent
    real = path.resolve()
    if root != real and root not in real.parents:
        raise ModelFormatError(f"{path}: a link to {real}, outside the model folder")
    size = real.stat().st_size
    if size > limit:
        raise ModelFormatError(f"{path}: {size} bytes, more than the {limit} this file may have")
    return real.read_text(encoding="utf-8")


class HFTokenizer(Tokenizer):
    """A HF tokenizer.json (via the `tokenizers` package) plus tokenizer_config.json,
    and eos ids from generation_config.json / config.json where present."""

    kind = "hf"

    def __init__(self, tokenizer_json, config_dir=None):
        import tokenizers

        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        folder = Path(config_dir) if config_dir is not None else path.parent
        spec = _read_json(path, MAX_TOKENIZER_JSON_BYTES)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelFormatError(f"{path}: cannot load tokenizer ({e})") from None
        self.path = path
        cfg_path = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        model_cfg_path = folder / "config.json"
        model_cfg = _read_json(model_cfg_path) if model_cfg_path.is_file() else {}
        gen_path = folder / "generation_config.json"
        gen_cfg = _read_json(gen_path) if gen_path.is_file() else {}
        tmpl = cfg.get("chat_template")
        if not tmpl and (folder / "chat_template.jinja").is_file():
            cfg = dict(cfg, chat_template=_read_model_text(folder, "chat_template.jinja", MAX_CHAT_TEMPLATE_BYTES))
        self._setup(spec, cfg, model_cfg, gen_cfg)

    def _setup(self, spec: dict, cfg: dict, model_cfg: dict, gen_cfg: dict) -> None:
        """Fills the attributes from tokenizer.json's ``spec`` (self._tok already loaded),
        tokenizer_config ``cfg``, config.json ``model_cfg`` and generation_config ``gen_cfg``."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        top = max(vocab.values()) if vocab else -1
        if top >= len(vocab) + MAX_VOCAB_HOLES:
            raise ModelFormatError(f"tokenizer: token id {top} with {len(vocab)} tokens in the vocabulary "
                                   f"(ids may run at most {MAX_VOCAB_HOLES} past the number of tokens)")
        self.vocab_size = max(top + 1, self._tok.get_vocab_size(with_added_tokens=True))
        id_to_tok: list[str | None] = [None] * self.vocab_size
        for t, i in vocab.items():
            id_to_tok[i] = t

        added = {a["id"]: a for a in spec.get("added_tokens") or [] if isinstance(a, dict) and "id" in a}
        self.special_ids = {i for i, a in added.items() if a.get("special")}

        def tid(value) -> int | None:
            content = _token_content(value)
            return None if content is None else self._tok.token_to_id(content)

        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_id = tid(cfg.get("bos_token"))
        if self.bos_id is None and isinstance(model_cfg.get("bos_token_id"), int):
            self.bos_id = _vocab_id(model_cfg["bos_token_id"], "bos_token_id", self.vocab_size)
            if self.bos_token is None:
                self.bos_token = id_to_tok[self.bos_id]
        eos: list[int] = []
        for value in (tid(cfg.get("eos_token")), gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and v not in eos:
                    eos.append(_vocab_id(v, "eos_token_id", self.vocab_size))
        self.eos_ids = eos
        self.eos_id = eos[0] if eos else None
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = id_to_tok[self.eos_id]
        for i in (self.bos_id, *eos):
            if i is not None:
                self.special_ids.add(i)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.add_eos_token = bool(cfg.get("add_eos_token", False))

        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        self.chat_template = tmpl if isinstance(tmpl, str) and tmpl else None

        # How token strings map to bytes.
        model = spec.get("model") or {}
        decoders = _components(spec.get("decoder"))
        dtypes = {d.get("type") for d in decoders}
        pre = {p.get("type") for p in _components(spec.get("pre_tokenizer"))}
        if "ByteLevel" in dtypes or (not decoders and "ByteLevel" in pre):
            self.style = "bytelevel"
        elif "Metaspace" in dtypes or "ByteFallback" in dtypes or model.get("byte_fallback") or any(
                d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "\u2581"
                for d in decoders):
            self.style = "metaspace"
        else:
            self.style = "plain"
        self.byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in dtypes
        self.strip_leading_space_after_bos = self.style == "metaspace" and (
            any(d.get("type") == "Strip" and d.get("content") == " " and d.get("start", 0) > 0 for d in decoders)
            or any(d.get("type") == "Metaspace" and (d.get("add_prefix_space") or
                                                     d.get("prepend_scheme") in ("always", "first"))
                   for d in decoders))

        self._bytes = [b""] * self.vocab_size
        for i, t in enumerate(id_to_tok):
            if t is None:
                continue
            if i in added:
                self._bytes[i] = t.encode("utf-8")
            elif self.style == "bytelevel":
                try:
                    self._bytes[i] = t.translate(_BYTELEVEL_TO_LATIN1).encode("latin-1")
                except UnicodeEncodeError:  # not all byte-level symbols
                    self._bytes[i] = t.encode("utf-8")
            elif self.style == "metaspace":
                m = _BYTE_PIECE.fullmatch(t.encode("utf-8")) if self.byte_fallback else None
                self._bytes[i] = bytes([int(m.group(1), 16)]) if m else t.replace("\u2581", " ").encode("utf-8")
            else:
                self._bytes[i] = t.encode("utf-8")

    def token_bytes(self, token_id: int) -> bytes:
        (i,) = _check_ids([token_id])
        return self._bytes[i] if i < self.vocab_size else b""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        return self._with_bos_eos(ids) if add_special_tokens else ids

    def _with_bos_eos(self, ids: list[int]) -> list[int]:
        """ids with BOS in front and EOS at the end where the tokenizer adds them and
        they are not there yet (the HF post-processor or the text may hold them already)."""
        if self.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        if self.add_eos_token and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [i for i in _check_ids(ids) if i < self.vocab_size]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


# ---------------------------------------------------------------------------- GGUF

# GGUF tokenizers live in gguf_tokenizer.py (which builds on HFTokenizer); these names
# stay importable from here.
_GGUF_NAMES = ("GGUFTokenizer", "GGUF_PRE_TOKENIZERS", "GGUF_METADATA_ARRAY_LIMIT", "MERGE_MAX_TOKEN_CHARS",
               "MAX_MERGES")


def _vocab_id(value: int, field: str, vocab_size: int) -> int:
    """``value`` when it is a token id of the vocabulary, else a ModelFormatError naming ``field``."""
    if not 0 <= value < vocab_size:
        raise ModelFormatError(f"tokenizer: {field} = {value} is not a token id below the vocabulary size "
                               f"{vocab_size}")
    return value


def __getattr__(name: str):
    if name in _GGUF_NAMES:
        from . import gguf_tokenizer

        return getattr(gguf_tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        from .gguf_tokenizer import GGUFTokenizer

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
