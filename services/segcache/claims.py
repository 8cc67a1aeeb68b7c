"""Build claims: who builds a cold segment when several routers miss it at once.

The first claimer of a key that is not cached holds it for `lease_s`; the same holder may renew
it; a Put of the key ends the claim (the entry is there to read); a claim whose builder died
simply expires, so a crashed scatter or router never wedges a key. Claims live in memory only:
a restarted segcache forgets them, which costs at most one duplicate build per key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

MAX_LEASE_S = 600.0
MAX_HOLDER_BYTES = 256


@dataclass
class Claim:
    holder: str
    expires_at: float  # time.monotonic()


@dataclass
class ClaimResult:
    key: str
    granted: bool
    cached: bool
    holder: str
    expires_in_s: float


class ClaimTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._claims: dict[str, Claim] = {}
        self.granted = 0
        self.contended = 0

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, key: str, holder: str, lease_s: float, cached: bool) -> ClaimResult:
        """Claim `key` for `holder` (or tell who holds it, or that the entry is there)."""
        now = self._clock()
        if cached:
            self._claims.pop(key, None)
            return ClaimResult(key, False, True, "", 0.0)
        c = self._claims.get(key)
        if c is not None and c.expires_at > now and c.holder != holder:
            self.contended += 1
            return ClaimResult(key, False, False, c.holder, c.expires_at - now)
        self._claims[key] = Claim(holder, now + lease_s)
        self.granted += 1
        return ClaimResult(key, True, False, holder, lease_s)

    def release(self, key: str) -> None:
        """The entry is in: waiters read it from now on."""
        self._claims.pop(key, None)

    def expire(self) -> int:
        """Drop expired claims (memory only: an expired claim is already as good as gone)."""
        now = self._clock()
        dead = [k for k, c in self._claims.items() if c.expires_at <= now]
        for k in dead:
            del self._claims[k]
        return len(dead)
