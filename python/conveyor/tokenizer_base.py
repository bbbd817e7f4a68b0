"""The interface every tokenizer shares (Tokenizer), the built-in chat format for
models without a template, and the checks of messages and token ids."""
from __future__ import annotations

import re
import warnings
from typing import Iterable, Sequence

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def render_default_chat(messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The built-in chat format: "{role}: {content}\\n" per message, then "assistant: "."""
    out = [f"{m['role']}: {m['content']}\n" for m in messages]
    if add_generation_prompt:
        out.append("assistant: ")
    return "".join(out)


def message_text(content, where: str = "content") -> str:
    """A message's content as text, in OpenAI's forms: a str, None (an assistant message
    with tool calls only: ""), or a list of {"type": "text", "text": str} parts, joined.
    TypeError/ValueError naming ``where`` (and the part) otherwise."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise TypeError(f"{at} must be a content part object, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ValueError(f"{at}: only content parts of type 'text' are supported, got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise TypeError(f"{at}.text must be a str, got {type(part.get('text')).__name__}")
            parts.append(part["text"])
        return "".join(parts)
    raise TypeError(f"{where} must be a str, a list of text parts or None, got {type(content).__name__}")


def _check_messages(messages) -> list[dict]:
    """The conversation with each message's content as text (the chat template reads strs)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise TypeError("messages must be a list of {'role': str, 'content': str} dicts")
    msgs = list(messages)
    if not msgs:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r}")
        if not isinstance(m["role"], str):
            raise TypeError(f"messages[{i}]['role'] must be a str, got {type(m['role']).__name__}")
        if not isinstance(m["content"], str):
            msgs[i] = {**m, "content": message_text(m["content"], f"messages[{i}]['content']")}
    return msgs


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text holds a lone surrogate at character {e.start}: not valid Unicode") from None
    return text


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
    ``strip_leading_space_after_bos``, ``chat_template`` (or None); ``_bytes``, the raw
    bytes of every id of the vocabulary (b"" for special tokens).
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
    _bytes: list[bytes]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """encode() of each text, in one call (a tokenizer in native code does them all
        without the GIL)."""
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of a token id; b"" for ids past the vocabulary."""
        (i,) = _check_ids([token_id])
        return self._bytes[i] if i < self.vocab_size else b""

    def encode_exact_bytes(self, data: bytes) -> list[int]:
        """Ids whose token bytes concatenate to exactly ``data``: no BOS, no dummy
        prefix, no special token (what a grammar engine needs to tokenize forced
        text). The tokenizer's own encoding when it is exact, else longest-match
        on bytes."""
        ids = self.encode(data.decode("utf-8", "replace"), add_special_tokens=False)
        # text that spells a special token ("<|im_end|>") is that text here, never the token
        if b"".join(self.token_bytes(i) for i in ids) == data and not any(i in self.special_ids for i in ids):
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
        known = self._bytes[:self.vocab_size]  # one slice, not a checked lookup per id
        if len(known) < self.vocab_size:
            raise IndexError(f"the tokenizer holds the bytes of {len(known)} ids, not {self.vocab_size}")
        return known + [b""] * (n - self.vocab_size)

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
