"""A tokenizer front that remembers the ids of short texts it has encoded.

Bad words (and other per-request word lists) repeat from request to request: a
client sends the same list every time. Each distinct text is tokenized once, all of
a request's new ones in one encode_batch call, and later requests find them in a
cache bounded in bytes (least recently used first out).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

# The text bytes the cache holds at most (ids count 8 bytes each): a few hundred
# requests' worth of bad words.
TOKEN_CACHE_BYTES = 8 << 20
# Longer texts are tokenized every time (caching them would evict many short ones).
TOKEN_CACHE_MAX_TEXT = 4096


class CachedEncoder:
    """encode_batch(texts) of a tokenizer (no special tokens), with a shared cache."""

    def __init__(self, tokenizer, max_bytes: int = TOKEN_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.max_bytes = int(max_bytes)
        self._cache: OrderedDict[str, tuple] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.texts_encoded = 0  # texts that reached the tokenizer (a cache miss each)
        self.batches = 0        # encode_batch calls made to the tokenizer

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        if add_special_tokens:
            raise ValueError("CachedEncoder encodes without special tokens")
        found: dict[str, tuple] = {}
        with self._lock:
            for t in texts:
                ids = self._cache.get(t)
                if ids is not None:
                    self._cache.move_to_end(t)
                    found[t] = ids
        missing = list(dict.fromkeys(t for t in texts if t not in found))
        if missing:
            encoded = self.tokenizer.encode_batch(missing, add_special_tokens=False)
            with self._lock:
                self.batches += 1
                self.texts_encoded += len(missing)
                for t, ids in zip(missing, encoded):
                    ids = tuple(ids)
                    found[t] = ids
                    if len(t) <= TOKEN_CACHE_MAX_TEXT and t not in self._cache:
                        self._cache[t] = ids
                        self._bytes += self._cost(t, ids)
                while self._bytes > self.max_bytes and self._cache:
                    old, old_ids = self._cache.popitem(last=False)
                    self._bytes -= self._cost(old, old_ids)
        return [list(found[t]) for t in texts]

    @staticmethod
    def _cost(text: str, ids: tuple) -> int:
        return len(text) + 8 * len(ids) + 64
