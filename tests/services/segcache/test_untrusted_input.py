"""What segcache must not trust: it stores sealed entries only, keeps uploads within a memory
budget, and survives damaged LMDB records and files. A real segcache process on 127.0.0.1, real
LMDB in tmp dirs; entries built by hand (tests/support/fake_entries.py), so no torch model."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.engine.pic.seal import ForgedEntry, open_sealed, seal
from common.mesh.segcache_client import SegcacheClient
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from tests.support.fake_entries import fake_entry, key_of
from tests.support.segcache_process import arun, code_of

pytestmark = pytest.mark.timeout(180)
KiB, MiB = 1 << 10, 1 << 20


# ---- sealed entries ----------------------------------------------------------------------------
def test_seal_binds_header_payload_and_key(fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    ids = rng.integers(0, 50_000, 40).tolist()
    secret = rng.bytes(32)
    entry = fake_entry(ids, rng.bytes(1000))
    sealed = seal(entry, secret)
    assert bytes(open_sealed(sealed, key_of(ids), secret)) == entry
    other_ids = list(ids)
    other_ids[rng.integers(0, 40)] ^= 1
    bad = {
        "wrong secret": (sealed, key_of(ids), rng.bytes(32)),
        "no secret": (sealed, key_of(ids), b""),
        "another key": (sealed, key_of(other_ids), secret),
        "another seam": (sealed, key_of(ids, seam=4), secret),
        "unsealed": (entry, key_of(ids), secret),
        "header rewritten and resealed without the secret": (
            seal(fake_entry(other_ids, entry[-1000:]), b""), key_of(other_ids), secret),
    }
    for i in range(0, len(sealed), max(1, len(sealed) // 50)):  # a flipped bit anywhere
        flipped = bytearray(sealed)
        flipped[i] ^= 1 << int(rng.integers(0, 8))
        bad[f"bit flip at {i}"] = (bytes(flipped), key_of(ids), secret)
    for name, (data, key, s) in bad.items():
        with pytest.raises(ForgedEntry):
            open_sealed(data, key, s)
            pytest.fail(name)


@pytest.mark.processes
def test_segcache_with_a_secret_stores_only_sealed_entries_for_their_key(launch, tmp_path: Path,
                                                                         fresh_seed: int) -> None:
    secret = os.urandom(16).hex().encode()
    (tmp_path / "entry.key").write_bytes(secret + b"\n")
    srv = launch("--no-nixl", "--entry-key-file", str(tmp_path / "entry.key"))
    rng = np.random.default_rng(fresh_seed)
    ids = rng.integers(0, 1000, 30).tolist()
    victim = rng.integers(0, 1000, 30).tolist()
    good = seal(fake_entry(ids, rng.bytes(4096)), secret)
    forged = seal(fake_entry(victim, rng.bytes(4096)), b"guess")

    async def run():
        async with SegcacheClient(srv.target) as sc:
            refused = {
                "random bytes": await code_of(sc.put(key_of(victim), rng.bytes(5000))),
                "wrong secret": await code_of(sc.put(key_of(victim), forged)),
                "under another key": await code_of(sc.put(key_of(victim), good)),
            }
            assert set(refused.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, refused
            assert [e.tier for e in await sc.lookup([key_of(victim)])] == [segcache_pb.TIER_MISS]
            assert (await sc.put(key_of(ids), good)).created
            assert bytes(await sc.get(key_of(ids))) == good
    arun(run())


# ---- memory within budget ------------------------------------------------------------------------
async def status_of(coro) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The largest RSS of `pid` seen while the `with` body runs (sampled every 10 ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0.0

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mib(self.pid))
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> "PeakRss":
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()


BUDGET_MIB, ENTRY_MIB, N = 64, 16, 20
# The peak over the RSS at start, concurrent or stalled, stays within the host tier (64 MiB) and
# the upload budget (64 MiB): the budget bounds everything in flight, what gRPC holds of streams
# not handed over yet included. What keeps the rest small: each stream's HTTP/2 window is fixed
# (--stream-window-bytes; gRPC's automatic windows are at least 4 MiB a stream), messages are
# 2 MiB at most, a failed Put drops its bytes at once, LMDB's commit frames the upload buffer in
# place. What is left: LMDB's own pages during a commit (one entry) and every stream's first
# message at once (20 x 1 MiB, in gRPC's buffers and then as Python bytes).
# Measured from ~69 MiB at start with the default 256 KiB window, load average 10-16 on 2 cores:
# 89-106 concurrent, 99-113 stalled; 96-162 and 101-131 with gRPC's automatic windows; before
# issue 30's second round 133-164 and 123-145 alone, 205 and 178 in a loaded whole-suite run.
PEAK_BOUND_MIB = BUDGET_MIB + BUDGET_MIB
# What stays after the uploads end: the host tier and a stated constant for allocator slack
# (measured 3-7 MiB over the host tier; 20-30 before freed heap pages were trimmed).
RETAINED_CONSTANT_MIB = 32
AFTER_BOUND_MIB = BUDGET_MIB + RETAINED_CONSTANT_MIB
STALLED_ROUNDS = 3
# Rounds of stalled uploads after the first keep no more than this in all (allocator noise;
# a leak kept ~110 MiB per round, 220 over these).
ROUND_GROWTH_MIB = 16


@pytest.mark.processes
def test_puts_stay_within_the_upload_budget(launch, fresh_seed: int) -> None:
    srv = launch("--no-nixl", "--no-lmdb-sync", "--host-bytes", f"{BUDGET_MIB}MiB", "--disk-bytes",
                 "1GiB", "--upload-budget-bytes", f"{BUDGET_MIB}MiB", "--upload-idle-timeout-s", "2")
    pid = srv.proc.pid
    rng = np.random.default_rng(fresh_seed)
    blobs = [rng.bytes(ENTRY_MIB * MiB) for _ in range(4)]  # 4 distinct blobs, 20 keys

    async def concurrent() -> tuple[dict, float]:
        clients = [SegcacheClient(srv.target) for _ in range(N)]
        try:
            async with PeakRss(pid) as rss:
                codes = await asyncio.gather(*(status_of(c.put(f"c{i}", blobs[i % 4]))
                                               for i, c in enumerate(clients)))
            return codes, rss.peak
        finally:
            for c in clients:
                await c.close()

    async def stalled() -> tuple[list, float]:
        async def put_then_stall(c: SegcacheClient, i: int):
            async def messages():
                yield segcache_pb.PutRequest(header=segcache_pb.PutHeader(key=f"s{i}", size=ENTRY_MIB * MiB),
                                    data=blobs[i % 4][:1 * MiB])
                await asyncio.sleep(3600)  # the client never sends the rest, never hangs up
            return await code_of(c.stub.Put(messages(), timeout=60))

        clients = [SegcacheClient(srv.target) for _ in range(N)]
        try:
            async with PeakRss(pid) as rss:
                codes = await asyncio.gather(*(put_then_stall(c, i) for i, c in enumerate(clients)))
            return codes, rss.peak
        finally:
            for c in clients:
                await c.close()

    base = rss_mib(pid)
    codes, peak = arun(concurrent())
    C = grpc.StatusCode
    # The server answers RESOURCE_EXHAUSTED; grpc's asyncio client, still writing when the status
    # arrives, may report its own "Internal error from Core" instead (grpc/grpc#36066).
    codes = [C.RESOURCE_EXHAUSTED if (c, d) == (C.INTERNAL, "Internal error from Core") else c
             for c, d in codes]
    assert set(codes) <= {C.OK, C.RESOURCE_EXHAUSTED} and C.OK in codes, set(codes)
    assert codes.count(C.OK) >= BUDGET_MIB // ENTRY_MIB
    mid = rss_mib(pid)
    rounds, peak2 = [], 0.0
    for _ in range(STALLED_ROUNDS):
        codes2, peak_round = arun(stalled())
        assert set(codes2) <= {C.DEADLINE_EXCEEDED, C.RESOURCE_EXHAUSTED}, set(codes2)
        assert codes2.count(C.DEADLINE_EXCEEDED) == BUDGET_MIB // ENTRY_MIB, codes2
        arun(asyncio.sleep(1.5))  # the failed uploads' cycles are collected within a second
        rounds.append(rss_mib(pid))
        peak2 = max(peak2, peak_round)
    after = rounds[-1]
    print(f"segcache RSS MiB: base {base:.0f}, peak concurrent {peak:.0f}, between {mid:.0f} "
          f"({codes.count(C.OK)} of {N} stored), peak stalled {peak2:.0f}, after rounds {rounds}")
    assert peak - base < PEAK_BOUND_MIB and peak2 - base < PEAK_BOUND_MIB, (base, peak, peak2)
    assert after - base < AFTER_BOUND_MIB, (base, after)
    assert rounds[-1] - rounds[0] < ROUND_GROWTH_MIB, rounds

    async def oversized_first_message():  # past --max-message-bytes: refused before it is held
        async def messages():
            yield segcache_pb.PutRequest(header=segcache_pb.PutHeader(key="big", size=ENTRY_MIB * MiB),
                                         data=blobs[0][:4 * MiB])
            await asyncio.sleep(3600)
        async with SegcacheClient(srv.target) as c:
            return await code_of(c.stub.Put(messages(), timeout=60))
    assert arun(oversized_first_message()) == C.RESOURCE_EXHAUSTED

    async def budget_is_free_again():
        async with SegcacheClient(srv.target) as c:
            assert (await c.put("again", blobs[0])).created
    arun(budget_is_free_again())
    assert srv.alive()


# ---- damaged LMDB records and files ------------------------------------------------------------
def make_store(tmp_path: Path, **kw):
    from services.segcache.config import SegcacheConfig
    from services.segcache.store import SegmentStore

    kw.setdefault("lmdb_sync", False)
    kw.setdefault("host_bytes", 0)  # every read comes from LMDB
    kw.setdefault("disk_bytes", 8 * MiB)
    return SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", **kw))


def blobs_for(rng, n: int, size: int) -> dict[str, bytes]:
    return {f"k{i}": rng.bytes(size + i) for i in range(n)}


def edit_meta(path: Path, key: str, edit) -> None:
    import lmdb

    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"meta")
        with env.begin(write=True, db=db) as txn:
            txn.put(key.encode(), bytes(edit(bytearray(txn.get(key.encode())))))
    finally:
        env.close()


@pytest.mark.parametrize("field_at", [12, 8, 4, -1])  # size, token count, a flipped bit anywhere
def test_a_damaged_meta_record_is_dropped_alone(tmp_path: Path, fresh_seed: int, field_at: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    data = blobs_for(rng, 40, 100 * KiB)  # ~4 MiB of an 8 MiB disk budget
    s = make_store(tmp_path)
    for k, v in data.items():
        s.put(k, v, token_count=7)
    s.close()
    victim = f"k{int(rng.integers(0, 40))}"

    def flip(raw: bytearray) -> bytearray:
        at = field_at if field_at >= 0 else int(rng.integers(0, len(raw)))
        raw[at + (3 if field_at == 12 else 0)] ^= 1 << int(rng.integers(0, 8))  # size: a high bit
        return raw
    edit_meta(tmp_path / "lmdb", victim, flip)
    s = make_store(tmp_path)
    try:
        st = s.stats()
        assert st["entries"] == 39 and st["corrupt_dropped"] == 1
        assert st["tiers"][2]["evictions"] == 0  # no good entry paid for the damaged one
        assert s.get(victim) is None
        for k, v in data.items():
            if k != victim:
                info, arr = s.get(k)
                assert arr.tobytes() == v and info.token_count == 7
    finally:
        s.close()


def test_lmdb_errors_on_read_are_a_miss_and_a_drop(tmp_path: Path, fresh_seed: int) -> None:
    """Zeroed pages under a running store: every read is the right bytes or a miss, never an
    error; entries that failed are gone."""
    rng = np.random.default_rng(fresh_seed)
    data = blobs_for(rng, 300, 900)  # small values: many keys per leaf page
    s = make_store(tmp_path)
    try:
        for k, v in data.items():
            s.put(k, v)
        path = tmp_path / "lmdb" / "data.mdb"
        n_pages = path.stat().st_size // 4096
        with open(path, "r+b") as f:  # the store's map sees the same page cache
            for page in rng.choice(np.arange(2, n_pages), size=max(1, n_pages // 4), replace=False):
                f.seek(int(page) * 4096)
                f.write(bytes(4096))
        missed = 0
        for k, v in data.items():
            got = s.get(k)
            if got is None:
                missed += 1
                assert s.get(k) is None and s.lookup([k]) == [None]  # dropped, not retried
            else:
                assert got[1].tobytes() == v
        assert missed > 0 and s.stats()["corrupt_dropped"] >= missed
    finally:
        s.close()


def test_a_store_whose_pages_are_zeroed_is_moved_aside_and_opens_empty(tmp_path: Path, fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    s = make_store(tmp_path)
    for k, v in blobs_for(rng, 50, 2000).items():
        s.put(k, v)
    s.close()
    path = tmp_path / "lmdb" / "data.mdb"
    raw = bytearray(path.read_bytes())
    raw[2 * 4096:] = bytes(len(raw) - 2 * 4096)  # the meta pages survive, nothing else
    path.write_bytes(raw)
    s = make_store(tmp_path)
    try:
        assert s.stats()["entries"] == 0
        s.put("fresh", b"x" * 100)
        assert s.get("fresh")[1].tobytes() == b"x" * 100
    finally:
        s.close()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("lmdb.damaged-")]
    assert len(aside) == 1 and (aside[0] / "data.mdb").read_bytes() == bytes(raw)  # kept as it was


@pytest.mark.processes
def test_a_truncated_data_file_is_one_log_line_and_an_empty_store(launch, tmp_path: Path) -> None:
    """SIGBUS before: LMDB mapped a file shorter than its meta page says."""
    srv = launch("--no-nixl", "--no-lmdb-sync")
    rng = np.random.default_rng(1)

    async def fill():
        async with SegcacheClient(srv.target) as c:
            for i in range(20):
                await c.put(f"k{i}", rng.bytes(200 * KiB))
    arun(fill())
    assert srv.terminate() == 0
    path = srv.data_dir / "data.mdb"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    srv.start()

    async def check():
        async with SegcacheClient(srv.target) as c:
            assert (await c.stats()).entries == 0
            assert (await c.put("after", b"abc")).created
    arun(check())
    lines = [json.loads(x) for x in srv.log().splitlines() if x.startswith("{") and "moved aside" in x]
    assert len(lines) == 1 and "truncated" in lines[0]["reason"], lines
    aside = Path(lines[0]["moved_to"])
    assert aside.exists() and (aside / "data.mdb").stat().st_size == size // 2
