"""The llama2.c tokenizer: a tokenizer.bin vocabulary of pieces and scores, merged
greedily by score as llama2.c's own encoder does (in C: csrc/model/llama2c_bpe.c)."""
from __future__ import annotations

import os
import struct
from pathlib import Path

from . import _core
from ._core import ModelFormatError
from .tokenizer_base import _BYTE_PIECE, Tokenizer, _check_ids, _check_text


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
        # llama2.c's merging, in C without the GIL (a server's other threads run meanwhile)
        self._bpe = _core.Llama2cBpe(pieces, scores, seed=int.from_bytes(os.urandom(8), "little"))

    def _raw(self, i: int) -> bytes:
        if i in self.special_ids:
            return b""
        p = self.pieces[i]
        m = _BYTE_PIECE.fullmatch(p)
        return bytes([int(m.group(1), 16)]) if m else p

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        lead: list[int] = []
        if add_special_tokens:
            lead.append(self.bos_id)
        if _check_text(text):
            lead.append(self._lookup.get(b" ", 0x20 + 3))  # dummy prefix
        return self._bpe.encode(lead, text.encode("utf-8"))

    def encode_exact_bytes(self, data: bytes) -> list[int]:
        return self._bpe.encode([], bytes(data))

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
