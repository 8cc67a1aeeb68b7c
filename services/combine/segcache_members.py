"""The segcache instances a combine may dial for a plan (issue 30): the members of its own
--segcache-address, never an address a plan makes up, since combine presents its writer
certificate to whatever it dials."""

from __future__ import annotations

import asyncio
import time

from common.mesh.abort import Abort
from common.mesh.discovery import MemberSet, parse_target
from common.mesh.segcache_ring import parse_addresses


def planned_segcache(planned: str, configured: str | None, known: list[str] | None = None) -> str | None:
    """The segcache instances a plan may use: those it names when each is a member combine knows
    (its --segcache-address ring, spelled the same; for a dns:/// target, `known`: its members as
    resolved now), else INVALID_ARGUMENT: a plan does not choose where combine connects, and
    presents its writer certificate. A plan naming none: the ring (a dns:/// target's members)."""
    if not planned.strip():  # a dns:/// target is placed over its members, never over its name
        return ",".join(known) if known else configured  # none resolved yet: the target itself
    members = set(known if known is not None else parse_addresses(configured))
    unknown = [a for a in parse_addresses(planned) if a not in members]
    if unknown:
        raise Abort.invalid(f"plan names segcache {', '.join(unknown)[:200]}, not a member this combine "
                            f"knows ({len(members)} from --segcache-address)")
    return planned


class SegcacheMembers:
    """The members of combine's segcache target that plans may name. A static list is what it
    says; a dns:/// target is re-resolved when a plan names a member not seen yet (one that joined
    since, or a first resolution that failed), at most once every `min_refresh_s`: a plan naming
    an unknown member waits for the next allowed refresh (<= min_refresh_s) rather than being
    refused on a stale list, and no plan makes combine query DNS more often than that."""

    def __init__(self, configured: str | None, min_refresh_s: float = 1.0):
        target = parse_target(configured) if configured else None
        # refresh_s=2.0: the resolver's timeout (this set is refreshed on demand, never by run())
        self.members = (MemberSet(target, refresh_s=2.0, what="segcache")
                        if target is not None and target.is_dns else None)
        self.min_refresh_s = min_refresh_s
        self._last_refresh = -float("inf")
        self._lock = asyncio.Lock()

    def _missing(self, names: list[str]) -> bool:
        assert self.members is not None
        return not self.members.resolved or any(a not in self.members.members for a in names)

    async def known(self, planned: str) -> list[str] | None:
        """The members to check `planned` against (None: the configured static list)."""
        if self.members is None:
            return None
        names = parse_addresses(planned) if planned.strip() else []
        if self._missing(names):
            async with self._lock:  # one resolution at a time; the others see its result
                if self._missing(names):
                    wait = self._last_refresh + self.min_refresh_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self._last_refresh = time.monotonic()
                    await self.members.refresh()
        return list(self.members.members)
