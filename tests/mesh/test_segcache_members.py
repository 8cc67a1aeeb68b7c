"""SegcacheRing over a dns: target (members found by the loopback DNS server of
tests/support/dns_server.py): real segcache processes on 127.0.0.{2,3,4} share one port; a record
added or removed changes the ring's members within a refresh, only the keys whose rendezvous
owner changed become misses (rebuilt by a Put on their new owner), every byte read back is the
byte written, and a name without records is an empty ring, never an exception from a lookup."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from common.mesh.segcache_ring import NoMembers, SegcacheRing, owner
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from tests.mesh.test_discovery import free_port_on
from tests.support.dns_server import LoopbackDNS
from tests.support.segcache_process import SegcacheProcess

pytestmark = pytest.mark.timeout(180)
IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
NAME = "segcache.test"


@pytest.fixture
def members(tmp_path: Path):
    """Three segcache processes, one per IP, all on the same port (what a headless Service gives)."""
    port = free_port_on(IPS)
    procs: list[SegcacheProcess] = []
    try:
        for i, ip in enumerate(IPS):
            d = tmp_path / f"s{i}"
            d.mkdir()
            procs.append(SegcacheProcess(d, ["--host", ip, "--port", str(port)], f"s{i}").start())
        yield port, procs
    finally:
        for p in procs:
            p.kill()


async def _wait_members(ring: SegcacheRing, want: list[str], timeout_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while sorted(ring.addresses) != sorted(want):
        assert time.monotonic() - t0 < timeout_s, (ring.addresses, want)
        await asyncio.sleep(0.05)


async def _hits(ring: SegcacheRing, keys: list[str]) -> set[str]:
    return {e.key for e in await ring.lookup(keys, timeout=5.0) if e.tier != segcache_pb.TIER_MISS}


@pytest.mark.processes
def test_ring_follows_dns_records_and_rehomes_only_moved_keys(members, fresh_seed):
    port, _ = members
    rng = random.Random(fresh_seed)
    keys = [f"seg-{rng.getrandbits(64):016x}" for _ in range(60)]
    blobs = {k: rng.randbytes(rng.randrange(1, 3000)) for k in keys}
    addr = [f"{ip}:{port}" for ip in IPS]

    async def scenario(dns: LoopbackDNS) -> None:
        dns.set(NAME, IPS[:2])
        async with SegcacheRing(dns.target(NAME, port), timeout_s=5.0, refresh_s=0.2) as ring:
            assert sorted(ring.addresses) == addr[:2]
            for k in keys:
                await ring.put(k, blobs[k], token_count=1)
            assert await _hits(ring, keys) == set(keys)

            # A member joins: exactly the keys it now owns miss (about a third), the rest hit.
            dns.set(NAME, IPS)
            await _wait_members(ring, addr)
            moved = {k for k in keys if owner(k, addr) == addr[2]}
            assert moved and all(owner(k, addr[:2]) != addr[2] for k in moved)
            assert await _hits(ring, keys) == set(keys) - moved
            for k in moved:                       # rebuilt: stored on the new owner
                await ring.put(k, blobs[k], token_count=1)
            assert await _hits(ring, keys) == set(keys)

            # A member leaves (its process still runs): its keys miss, no call fails.
            dns.set(NAME, IPS[1:])
            await _wait_members(ring, addr[1:])
            gone = {k for k in keys if owner(k, addr) == addr[0]}
            assert await _hits(ring, keys) == set(keys) - gone
            for k in gone:
                assert ring.owner(k) == owner(k, addr[1:])
                await ring.put(k, blobs[k], token_count=1)
            for k in keys:                        # every byte read back is the byte written
                assert bytes(await ring.get(k)) == blobs[k]

            # No records: an empty ring. Lookups miss, claims grant, Puts fail as "unavailable".
            dns.remove(NAME)
            await _wait_members(ring, [])
            assert await _hits(ring, keys) == set()
            assert all(c.granted for c in await ring.claim(keys[:5], "h", 5.0))
            with pytest.raises(NoMembers):
                await ring.put(keys[0], blobs[keys[0]], token_count=1)
            assert isinstance(NoMembers("x"), OSError)

            dns.set(NAME, IPS[:1])                # back: its LMDB still holds its keys
            await _wait_members(ring, addr[:1])
            held = {k for k in keys if owner(k, addr[:2]) == addr[0]}  # put there at the start
            assert held <= await _hits(ring, keys)

    with LoopbackDNS() as dns:
        asyncio.run(scenario(dns))


def test_static_ring_needs_addresses_and_a_dns_ring_does_not():
    with pytest.raises(ValueError):
        SegcacheRing("")
    with pytest.raises(ValueError):
        SegcacheRing("dns:///a/b:1")            # malformed: a ValueError at start-up

    async def scenario() -> None:
        ring = SegcacheRing("dns://127.0.0.1:9/none.test:1", refresh_s=0.2)
        assert ring.addresses == [] and ring.target == "dns://127.0.0.1:9/none.test:1"
        await ring.close()                      # never started: nothing to stop
    asyncio.run(scenario())


def test_departed_members_leave_placement_at_once_and_close_after_the_grace(monkeypatch, fresh_seed):
    import common.mesh.segcache_ring as ring_module
    monkeypatch.setattr(ring_module, "RETIRE_GRACE_S", 0.2)
    rng = random.Random(fresh_seed)
    keys = [f"seg-{rng.getrandbits(64):016x}" for _ in range(200)]
    a, b, c = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"   # channels connect lazily: nothing dialled

    async def scenario() -> None:
        ring = SegcacheRing("dns://127.0.0.1:9/none.test:1", refresh_s=0.2)
        ring.set_members([a, b, c])
        assert {ring.owner(k) for k in keys} == {a, b, c}
        ring.set_members([b, c])                  # a leaves: out of placement now, client kept
        assert all(ring.owner(k) == owner(k, [b, c]) for k in keys) and a in ring.clients
        ring.set_members([b])                     # c leaves ...
        await asyncio.sleep(0.1)
        ring.set_members([b, c])                  # ... and is back within the grace: kept
        await asyncio.sleep(0.3)
        assert a not in ring.clients and set(ring.clients) == {b, c}
        ring.set_members([b])                     # c leaves, returns, leaves again: its last
        await asyncio.sleep(0.1)                  # departure's grace counts, not the first's
        ring.set_members([b, c])
        ring.set_members([b])
        await asyncio.sleep(0.15)
        assert c in ring.clients
        await asyncio.sleep(0.15)
        assert set(ring.clients) == {b}
        await ring.close()
    asyncio.run(scenario())
