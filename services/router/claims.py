"""One build per cold segment across routers: claim the misses in segcache.

A granted claim means "build it" (as before claims existed). A key whose claim another request
holds is planned as a segcache segment with `wait_s`: combine polls segcache for its entry while
the plan's own builds run (so two routers each holding some of the other's keys never wait on
each other), and builds it itself if the entry does not come in time (the builder died or its
Put failed: a duplicate build at worst, never a failed request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from common.mesh.segcache_ring import SegcacheRing
from services.router import metrics as m

log = structlog.get_logger("router.claims")


@dataclass
class Claimed:
    cached: list[str] = field(default_factory=list)          # put by someone since our Lookup
    waiting: dict[str, float] = field(default_factory=dict)  # key -> how long to wait for it


async def claim_misses(ring: SegcacheRing, keys: list[str], holder: str, lease_s: float,
                       wait_cap_s: float, request_id: str, timeout_s: float) -> Claimed:
    """Claim `keys`; those neither cached nor waited for are ours to build. Never raises for a
    segcache fault (SegcacheRing.claim grants the keys of an instance that failed)."""
    out = Claimed()
    if wait_cap_s <= 0:
        return out
    for r in await ring.claim(keys, holder, lease_s, request_id=request_id, timeout=timeout_s):
        if r.cached:
            out.cached.append(r.key)
        elif not r.granted:
            # The holder's lease bounds the wait: past it the holder is presumed dead.
            out.waiting[r.key] = min(wait_cap_s, max(r.expires_in_s, 0.0))
    granted = len(keys) - len(out.cached) - len(out.waiting)
    m.CLAIMS.labels("granted").inc(granted)
    m.CLAIMS.labels("cached").inc(len(out.cached))
    m.CLAIMS.labels("wait").inc(len(out.waiting))
    if out.waiting:
        log.info("segments being built elsewhere; combine waits for their entries",
                 keys=len(out.waiting), granted=granted)
    return out
