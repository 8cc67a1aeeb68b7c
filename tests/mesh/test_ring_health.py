"""A segcache member that fails is skipped on lookup until it recovers: while it is out, an entry
Put while it was out (re-homed to a healthy member) is found by the next lookups instead of being
a miss, and so rebuilt, on every request; once the member answers again (after the cooldown) its
keys are its own again. Real segcache processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from common.mesh.segcache_client import SegcacheClient
from common.mesh.segcache_ring import SegcacheRing, owner
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from tests.support.segcache_process import SegcacheProcess

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

COOLDOWN_S = 1.0


@pytest.fixture
def members(tmp_path: Path):
    procs = []
    for i in range(2):
        (tmp_path / f"s{i}").mkdir()
        procs.append(SegcacheProcess(tmp_path / f"s{i}", [], f"s{i}").start())
    yield procs
    for p in procs:
        p.kill()


def test_lookup_skips_a_failed_member_until_it_recovers(members, fresh_seed) -> None:
    rng = random.Random(fresh_seed)
    addrs = [p.target for p in members]
    sick = members[1]
    # A key whose owner, while every member is healthy, is the one that will fail.
    key = next(k for k in (f"seg-{rng.getrandbits(64):016x}" for _ in range(1000))
               if owner(k, addrs) == sick.target)
    data = rng.randbytes(3000)

    async def run() -> None:
        async with SegcacheRing(",".join(addrs), timeout_s=3.0, cooldown_s=COOLDOWN_S) as ring:
            sick.kill()
            # The first lookup finds the member down: a miss, and the member leaves placement.
            [info] = await ring.lookup([key], timeout=2.0)
            assert info.tier == segcache_pb.TIER_MISS and sick.target not in ring.healthy()
            await ring.put(key, data, token_count=1)  # re-homed to the healthy member
            for _ in range(3):  # later requests find it there: a hit each time, not a rebuild
                entries, asked, failed = await ring.lookup_reporting([key], timeout=2.0)
                assert entries[0].tier != segcache_pb.TIER_MISS
                assert asked == [members[0].target] and failed == []
            assert bytes(await ring.get(key)) == data

            # The member comes back on its port (empty: its data directory is its own, never
            # given this key); after the cooldown the key is its again, so a miss there.
            back = SegcacheProcess(sick.port_file.parent, ["--port", str(sick.port)], "s1-back")
            members.append(back.start())
            async with SegcacheClient(sick.target, timeout_s=5.0) as c:
                await c.wait_ready(10.0)
            await asyncio.sleep(COOLDOWN_S + 0.2)
            assert sick.target in ring.healthy()
            # The ring's channel reconnects within its backoff (<= 1 s); a lookup that still
            # fails sends the member back out for another cooldown.
            for _ in range(40):
                entries, asked, failed = await ring.lookup_reporting([key], timeout=3.0)
                if asked == [sick.target] and not failed:
                    break
                await asyncio.sleep(0.25)
            assert asked == [sick.target] and failed == []
            assert entries[0].tier == segcache_pb.TIER_MISS

    asyncio.run(run())
