"""Many segcache instances behind SegcacheRing: rendezvous placement (how many keys move when one
of N instances comes or goes), and real segcache processes on 127.0.0.1 (one killed: its keys are
misses, never a failed lookup; back on its port: its keys are its own again)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from common.mesh.segcache_client import SegcacheClient
from common.mesh.segcache_ring import SegcacheRing, group_by_owner, owner, parse_addresses, weight
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from tests.support.segcache_process import SegcacheProcess

pytestmark = pytest.mark.timeout(180)


def _keys(rng: random.Random, n: int) -> list[str]:
    return [f"seg-{rng.getrandbits(64):016x}" for _ in range(n)]


def _addresses(rng: random.Random, n: int) -> list[str]:
    return [f"10.{rng.randrange(256)}.{rng.randrange(256)}.{i}:{rng.randrange(1024, 65536)}"
            for i in range(n)]


def test_parse_addresses():
    assert parse_addresses(" a:1, b:2,,a:1 ,") == ["a:1", "b:2"]
    assert parse_addresses(["x:1", " x:1", "y:2"]) == ["x:1", "y:2"]
    assert parse_addresses("") == [] and parse_addresses(None) == []
    with pytest.raises(ValueError):
        owner("k", [])


def test_owner_is_the_highest_weight_and_independent_of_order(fresh_seed):
    rng = random.Random(fresh_seed)
    addrs = _addresses(rng, 5)
    for k in _keys(rng, 200):
        best = max(addrs, key=lambda a: weight(a, k))
        assert owner(k, addrs) == best
        shuffled = addrs[:]
        rng.shuffle(shuffled)
        assert owner(k, shuffled) == best


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_or_removing_one_of_n_moves_about_one_nth(fresh_seed, n):
    rng = random.Random(fresh_seed + n)
    keys = _keys(rng, 20000)
    addrs = _addresses(rng, n + 1)
    before = {k: owner(k, addrs[:n]) for k in keys}
    after = {k: owner(k, addrs) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    # Only keys that now belong to the new instance move, and about 1/(n+1) of them do.
    assert all(after[k] == addrs[n] for k in moved)
    frac = len(moved) / len(keys)
    print(f"[ring] add 1 to {n}: moved {frac:.4f} (ideal {1 / (n + 1):.4f})")
    assert abs(frac - 1 / (n + 1)) < 0.02
    # Removing one of the n: only its keys move (about 1/n), spread over the others.
    gone = addrs[rng.randrange(n)]
    rest = [a for a in addrs[:n] if a != gone]
    moved = [k for k in keys if owner(k, rest) != before[k]]
    assert set(moved) == {k for k in keys if before[k] == gone}
    frac = len(moved) / len(keys)
    print(f"[ring] remove 1 of {n}: moved {frac:.4f} (ideal {1 / n:.4f})")
    assert abs(frac - 1 / n) < 0.02
    # Balanced: every instance holds about 1/n of the keys.
    groups = group_by_owner(keys, addrs[:n])
    assert all(abs(len(g) / len(keys) - 1 / n) < 0.03 for g in groups.values())


# ---- real segcache processes ---------------------------------------------------------------------
@pytest.fixture
def instances(tmp_path: Path):
    procs: list[SegcacheProcess] = []
    for i in range(3):
        d = tmp_path / f"s{i}"
        d.mkdir()
        procs.append(SegcacheProcess(d, [], f"s{i}").start())
    yield procs
    for p in procs:
        p.kill()


@pytest.mark.processes
def test_ring_places_each_key_on_its_owner_and_survives_a_dead_instance(instances, fresh_seed):
    rng = random.Random(fresh_seed)
    addrs = [p.target for p in instances]
    keys = _keys(rng, 30)
    blobs = {k: rng.randbytes(rng.randrange(1, 5000)) for k in keys}

    async def run():
        async with SegcacheRing(",".join(addrs), timeout_s=5.0, cooldown_s=1.0) as ring:
            for k in keys:
                await ring.put(k, blobs[k], token_count=1)
            # Each key lives on its owner and nowhere else.
            for a in addrs:
                async with SegcacheClient(a, timeout_s=5.0) as c:
                    infos = await c.lookup(keys)
                held = {e.key for e in infos if e.tier != segcache_pb.TIER_MISS}
                assert held == {k for k in keys if owner(k, addrs) == a}
            assert all(e.tier != segcache_pb.TIER_MISS for e in await ring.lookup(keys))
            for k in rng.sample(keys, 5):
                assert bytes(await ring.get(k)) == blobs[k]

            # One instance dies: its keys are misses, the others still hits; no exception.
            dead = instances[1]
            dead.kill()
            t = time.monotonic()
            infos = await ring.lookup(keys, timeout=2.0)
            assert time.monotonic() - t < 3.0
            hit = {e.key for e in infos if e.tier != segcache_pb.TIER_MISS}
            assert hit == {k for k in keys if owner(k, addrs) != dead.target}
            assert dead.target not in ring.healthy()
            # While it is out, its keys are placed on the others (a Put there works).
            lost = next(k for k in keys if owner(k, addrs) == dead.target)
            assert ring.owner(lost) != dead.target
            await ring.put(lost, blobs[lost], token_count=1)
            assert bytes(await ring.get(lost)) == blobs[lost]

            # Back on its port with its LMDB: its keys are its own again (every one was put
            # there before it died; `lost` also has a copy where it went meanwhile).
            back = SegcacheProcess(dead.port_file.parent, ["--port", str(dead.port)], "s1-again")
            instances.append(back.start())
            await asyncio.sleep(1.2)  # the cooldown
            assert dead.target in ring.healthy()
            assert ring.owner(lost) == dead.target
            async with SegcacheClient(dead.target, timeout_s=5.0) as c:
                await c.wait_ready(10.0)
            for attempt in range(20):  # the ring's channel reconnects within its backoff (<= 1 s)
                infos = await ring.lookup(keys, timeout=5.0)
                hit = {e.key for e in infos if e.tier != segcache_pb.TIER_MISS}
                if hit == set(keys):
                    break
                await asyncio.sleep(0.25)
            assert hit == set(keys)
            for attempt in range(20):  # the ring's channel reconnects within its backoff (<= 1 s)
                try:
                    await ring.put(lost, blobs[lost], token_count=1)
                    break
                except Exception:
                    await asyncio.sleep(0.25)
            async with SegcacheClient(dead.target, timeout_s=5.0) as c:
                assert bytes(await c.get(lost)) == blobs[lost]

    asyncio.run(run())
