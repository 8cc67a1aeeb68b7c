"""A router waits for another router's build of a segment no longer than that router's claim
still runs: if the holder died, a later request takes the build over within one lease, not after
the router's whole wait cap (claim_wait_s). Against a real segcache process."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from common.mesh.segcache_ring import SegcacheRing
from services.router.claims import claim_misses
from tests.support.segcache_process import SegcacheProcess

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

LEASE_S = 1.0     # the dead holder's lease
WAIT_CAP_S = 30.0  # the waiting router's cap: far longer than the lease


@pytest.fixture
def segcache(tmp_path: Path):
    proc = SegcacheProcess(tmp_path, [], "claims").start()
    yield proc
    proc.kill()


def test_waiter_takes_over_within_one_lease_of_a_dead_holder(segcache, fresh_seed) -> None:
    rng = random.Random(fresh_seed)
    key = f"seg-{rng.getrandbits(64):016x}"

    async def run() -> None:
        async with SegcacheRing(segcache.target, timeout_s=5.0) as ring:
            # Another router claims the segment, then dies before building it.
            [dead] = await ring.claim([key], "router-that-died", LEASE_S)
            assert dead.granted
            t0 = time.monotonic()
            claimed = await claim_misses(ring, [key], "router-alive", 10.0, WAIT_CAP_S, "rid", 5.0)
            assert key in claimed.waiting and not claimed.cached
            # The wait is bounded by what is left of the holder's lease, not by the cap.
            assert 0.0 < claimed.waiting[key] <= LEASE_S
            # Once that much time has passed, the next request's claim is granted: it builds.
            await asyncio.sleep(max(0.0, t0 + claimed.waiting[key] - time.monotonic()) + 0.05)
            again = await claim_misses(ring, [key], "router-alive", 10.0, WAIT_CAP_S, "rid", 5.0)
            assert key not in again.waiting and key not in again.cached

    asyncio.run(run())
