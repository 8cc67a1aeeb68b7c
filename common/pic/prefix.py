"""The Prefix Cache baseline: exact reuse of the longest segment-aligned prefix seen before.

Model states are kept at segment boundaries (as SGLang's and vLLM's hybrid prefix caches keep
them), keyed by a chained hash of the segments so far, bounded in bytes, evicted LRU.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from common.state import ModelState


def chain_keys(fingerprint: str, dtype: str, segments: list[list[int]]) -> list[str]:
    """keys[j] identifies the prefix segments[0..j] (boundaries included)."""
    keys, h = [], hashlib.blake2b(digest_size=20, person=b"hypic-prefix-v1")
    h.update(fingerprint.encode() + b"\0" + dtype.encode())
    for seg in segments:
        h.update(struct.pack(f"<I{len(seg)}I", len(seg), *seg))
        keys.append(h.copy().hexdigest())
    return keys


class PrefixCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[ModelState, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> ModelState | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, state: ModelState) -> None:
        if key in self._items:
            self._items.move_to_end(key)
            return
        size = state.nbytes()
        if size > self.max_bytes:
            return
        self._items[key] = (state, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, s) = self._items.popitem(last=False)
            self.bytes -= s

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0
