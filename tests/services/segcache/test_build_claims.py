"""Build claims (one build per cold segment across routers): the claim table, the Claim RPC on a
real segcache, and two routers on two shared segcaches (each router with its own scatter worker,
so only the claims can keep them from building the same segment twice) counting builds."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

import hypic
from common.mesh.segcache_client import SegcacheClient
from hypic.launcher import Service
from services.segcache.claims import ClaimTable
from tests.support.segcache_process import SegcacheProcess
from tests.support.tiny import PIC_CONFIGS, save_tiny

pytestmark = pytest.mark.timeout(400)
SEAM = 8


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_claim_table_first_claimer_wins_until_put_or_expiry():
    clock = FakeClock()
    table = ClaimTable(clock)
    a = table.claim("k", "A", 5.0, cached=False)
    assert a.granted and not a.cached
    b = table.claim("k", "B", 5.0, cached=False)
    assert not b.granted and b.holder == "A" and math.isclose(b.expires_in_s, 5.0)
    assert table.claim("k", "A", 5.0, cached=False).granted  # the holder renews
    clock.t += 4.0
    assert not table.claim("k", "B", 5.0, cached=False).granted
    clock.t += 1.5  # A's renewed lease (5 s from t=100) has run out: A died
    assert table.claim("k", "B", 5.0, cached=False).granted
    table.release("k")  # B's Put
    c = table.claim("k", "C", 5.0, cached=True)
    assert c.cached and not c.granted and len(table) == 0
    table.claim("x", "A", 1.0, cached=False)
    clock.t += 2.0
    assert table.expire() == 1 and len(table) == 0


@pytest.mark.processes
def test_claim_rpc_on_a_real_segcache(tmp_path: Path, fresh_seed):
    rng = random.Random(fresh_seed)
    seg = SegcacheProcess(tmp_path, [], "claims").start()
    try:
        async def run():
            async with SegcacheClient(seg.target, timeout_s=5.0) as c:
                k1, k2 = f"k-{rng.getrandbits(48):x}", f"k-{rng.getrandbits(48):x}"
                r = await c.claim([k1, k2], "A", 30.0)
                assert [x.granted for x in r] == [True, True]
                r = await c.claim([k1, k2], "B", 30.0)
                assert [(x.granted, x.holder) for x in r] == [(False, "A"), (False, "A")]
                await c.put(k1, rng.randbytes(1000), token_count=4)  # ends k1's claim
                r = await c.claim([k1, k2], "B", 30.0)
                assert (r[0].cached, r[0].granted) == (True, False) and not r[1].granted
                # A claim whose holder died expires.
                k3 = f"k-{rng.getrandbits(48):x}"
                assert (await c.claim([k3], "dead", 0.3))[0].granted
                assert not (await c.claim([k3], "B", 30.0))[0].granted
                await asyncio.sleep(0.4)
                assert (await c.claim([k3], "B", 30.0))[0].granted
                for bad in ({"keys": [], "holder": "A", "lease_s": 1.0},
                            {"keys": [k3], "holder": "", "lease_s": 1.0},
                            {"keys": [k3], "holder": "A", "lease_s": 0.0},
                            {"keys": [k3], "holder": "A", "lease_s": float("nan")},
                            {"keys": [k3], "holder": "A", "lease_s": 1e9},
                            {"keys": [""], "holder": "A", "lease_s": 1.0}):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await c.claim(bad["keys"], bad["holder"], bad["lease_s"])
                    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert seg.alive()
        asyncio.run(run())
    finally:
        seg.kill()


# ---- two routers, two segcaches, one build per segment --------------------------------------------
def _svc(base: Path, name: str, kind: str, args: list[str]) -> Service:
    return Service(name=name, kind=kind, args=args, run_dir=base / "run", log_dir=base / "log")


def _start(services: list[Service]) -> None:
    for s in services:
        s.start()
    deadline = time.monotonic() + 240
    for s in services:
        s.wait_ready(deadline)


def _events(svc: Service, event: str) -> list[dict]:
    out = []
    for line in svc.log().splitlines():
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("event") == event:
                out.append(d)
    return out


@pytest.fixture(scope="module")
def two_routers(tmp_path_factory):
    base = tmp_path_factory.mktemp("claims")
    model = save_tiny("qwen3_5_text", base / "model", seed=7, **PIC_CONFIGS["qwen3_5_text"])
    common = ["--model", str(model), "--threads", "1"]
    segs = [_svc(base, f"seg{i}", "segcache", ["--data-dir", str(base / f"seg{i}")]) for i in range(2)]
    started: list[Service] = []
    try:
        _start(segs)
        started += segs
        seg_list = ",".join(s.address for s in segs)
        workers = [_svc(base, f"scatter{i}", "scatter", common + ["--segcache-address", seg_list])
                   for i in range(2)]
        combine = _svc(base, "combine0", "combine", common + ["--segcache-address", seg_list])
        _start(workers + [combine])
        started += workers + [combine]
        routers = [_svc(base, f"router{i}", "router", [
            "--model", str(model), "--seam", str(SEAM), "--segcache-address", seg_list,
            "--scatter-addresses", workers[i].address, "--combine-addresses", combine.address])
            for i in range(2)]
        _start(routers)
        started += routers
        yield {"segs": segs, "workers": workers, "combine": combine, "routers": routers}
    finally:
        for s in reversed(started):
            s.stop(grace_s=5)


@pytest.mark.processes
def test_two_routers_missing_the_same_segments_build_each_once(two_routers, fresh_seed):
    rng = random.Random(fresh_seed)
    docs = [[rng.randrange(1, 500) for _ in range(rng.randrange(200, 400))] for _ in range(6)]
    query = [rng.randrange(1, 500) for _ in range(12)]
    routers, workers = two_routers["routers"], two_routers["workers"]
    built_before = sum(len(_events(w, "built")) for w in workers)
    results: list = [None, None]

    def ask(i: int) -> None:
        with hypic.Client(routers[i].address, timeout=120) as c:
            results[i] = c.generate(docs, query, max_tokens=6, stream=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r is not None for r in results), results
    assert results[0].tokens == results[1].tokens
    deadline = time.monotonic() + 10  # "built" is logged when the build ends; let logs flush
    while time.monotonic() < deadline:
        built = sum(len(_events(w, "built")) for w in workers) - built_before
        if built >= len(docs):
            break
        time.sleep(0.1)
    per_worker = [len(_events(w, "built")) for w in workers]
    print(f"[claims] builds per worker {per_worker} for {len(docs)} segments")
    assert built == len(docs), per_worker
    # Both routers' answers used every segment: the waiter read from segcache what the other built.
    sources = [sorted(s.source for s in r.timings.trace) for r in results]
    assert any(src.count("segcache") > 0 for src in sources), sources
    # A second round is all hits, no build.
    with hypic.Client(routers[1].address, timeout=120) as c:
        again = c.generate(docs, query, max_tokens=6, stream=False)
    assert again.tokens == results[0].tokens
    assert sum(len(_events(w, "built")) for w in workers) - built_before == len(docs)
