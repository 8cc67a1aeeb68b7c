"""Eviction policies. Each tier owns one instance that tracks the tier's *evictable* entries
(pinned and leased entries are taken out of it and put back when they become evictable again).

GDSF (GreedyDual-Size-Frequency, Cherkasova 1998): an entry's priority is

    H = L + frequency × cost / size

where cost is the writer's estimated recompute time (seconds), size its bytes and frequency
its hit count (1 on insert). The victim is the entry of lowest H, and L (the tier's "inflation"
value) becomes that victim's H, so entries that stopped being hit age out even when they were
once valuable. Ties go to the entry whose priority was set longest ago.

LRU: the least recently inserted-or-hit entry is the victim.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict


class Policy(ABC):
    name: str = ""

    def __init__(self) -> None:
        self.bytes = 0  # bytes of the evictable entries tracked

    @abstractmethod
    def add(self, key: str, size: int, cost: float, freq: int) -> None:
        """Track key (replacing any previous record of it)."""

    @abstractmethod
    def touch(self, key: str, freq: int) -> None:
        """A hit on key (ignored when key is not tracked)."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Stop tracking key; False if it was not tracked."""

    @abstractmethod
    def pop_victim(self) -> str | None:
        """Remove and return the next entry to evict, or None if nothing is evictable."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def order(self) -> list[str]:
        """Keys in eviction order (first = next victim); for tests and debugging."""
        raise NotImplementedError


class LRUPolicy(Policy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._od: OrderedDict[str, int] = OrderedDict()

    def add(self, key: str, size: int, cost: float, freq: int) -> None:
        self.remove(key)
        self._od[key] = size
        self.bytes += size

    def touch(self, key: str, freq: int) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def remove(self, key: str) -> bool:
        size = self._od.pop(key, None)
        if size is None:
            return False
        self.bytes -= size
        return True

    def pop_victim(self) -> str | None:
        if not self._od:
            return None
        key, size = self._od.popitem(last=False)
        self.bytes -= size
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def order(self) -> list[str]:
        return list(self._od)


class GDSFPolicy(Policy):
    name = "gdsf"

    def __init__(self) -> None:
        super().__init__()
        self.inflation = 0.0  # L
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[float, int, int, float]] = {}  # key -> (H, seq, size, cost)
        self._seq = itertools.count()

    def priority(self, size: int, cost: float, freq: int) -> float:
        return self.inflation + max(freq, 1) * max(cost, 0.0) / max(size, 1)

    def _push(self, key: str, size: int, cost: float, freq: int) -> None:
        h = self.priority(size, cost, freq)
        seq = next(self._seq)
        self._live[key] = (h, seq, size, cost)
        heapq.heappush(self._heap, (h, seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale heap records
            self._heap = [(h, s, k) for k, (h, s, _, _) in self._live.items()]
            heapq.heapify(self._heap)

    def add(self, key: str, size: int, cost: float, freq: int) -> None:
        self.remove(key)
        self.bytes += size
        self._push(key, size, cost, freq)

    def touch(self, key: str, freq: int) -> None:
        rec = self._live.get(key)
        if rec is not None:
            self._push(key, rec[2], rec[3], freq)

    def remove(self, key: str) -> bool:
        rec = self._live.pop(key, None)
        if rec is None:
            return False
        self.bytes -= rec[2]
        return True

    def pop_victim(self) -> str | None:
        while self._heap:
            h, seq, key = heapq.heappop(self._heap)
            rec = self._live.get(key)
            if rec is not None and rec[1] == seq:
                del self._live[key]
                self.bytes -= rec[2]
                self.inflation = max(self.inflation, h)
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def order(self) -> list[str]:
        return [k for k, _ in sorted(self._live.items(), key=lambda kv: (kv[1][0], kv[1][1]))]


def make_policy(name: str) -> Policy:
    name = name.lower()
    if name == "gdsf":
        return GDSFPolicy()
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r} (gdsf, lru)")
