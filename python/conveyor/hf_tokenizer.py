"""A Hugging Face tokenizer: tokenizer.json through the `tokenizers` package, with
tokenizer_config.json's special tokens and chat template and the eos ids of
generation_config.json / config.json; every file read under a size cap."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ._core import ModelFormatError
from .tokenizer_base import _BYTE_PIECE, Tokenizer, _check_ids, _check_text


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([_check_text(text)], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        # `tokenizers` encodes a batch without the GIL (a single encode() holds it
        # throughout: seconds for a megabyte, with every other thread stopped); the
        # fast variant skips the offsets, whose freeing alone held the GIL 0.1 s there
        if self._tok is None:
            return super().encode_batch(texts, add_special_tokens)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        out = encode([_check_text(t) for t in texts], add_special_tokens=add_special_tokens)
        return [self._with_bos_eos(list(e.ids)) if add_special_tokens else list(e.ids) for e in out]

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


def _vocab_id(value: int, field: str, vocab_size: int) -> int:
    """``value`` when it is a token id of the vocabulary, else a ModelFormatError naming ``field``."""
    if not 0 <= value < vocab_size:
        raise ModelFormatError(f"tokenizer: {field} = {value} is not a token id below the vocabulary size "
                               f"{vocab_size}")
    return value
