"""Issue 14 (trust) at segcache: sealed entries only, uploads within a memory budget, damaged
LMDB records and files. A real segcache process on 127.0.0.1, real LMDB in tmp dirs.

Entries here are built by hand (b"HYPE" | u32 header length | header JSON | payload): segcache
reads only the header, and this module needs no torch model."""
from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.fingerprint import segment_key
from common.pic.seal import ForgedEntry, open_sealed, seal
from common.rpc.segcache_client import SegcacheClient
from protos.hypic.v1 import segcache_pb2 as pb
from test_segcache_service import arun, code_of, launch  # noqa: F401  (launch: a fixture)

pytestmark = pytest.mark.timeout(180)
KiB, MiB = 1 << 10, 1 << 20
FP = "ab" * 32


def fake_entry(token_ids: list[int], payload: bytes, seam: int = 8) -> bytes:
    header = json.dumps({"version": 1, "token_ids": token_ids, "seam": seam, "fingerprint": FP,
                         "dtype": "float32", "layers": [], "checksum": ""}).encode()
    return b"HYPE" + struct.pack("<I", len(header)) + header + payload


def key_of(token_ids: list[int], seam: int = 8) -> str:
    return segment_key(FP, seam, "float32", token_ids)


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
            assert [e.tier for e in await sc.lookup([key_of(victim)])] == [pb.TIER_MISS]
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
# Over the RSS at start: the host tier (64 MiB) + uploads (64 MiB) + the messages grpc holds for
# refused streams, and allocator slack.
# (measured here from ~243 MiB at start: peaks ~400 MiB concurrent and ~480 MiB stalled, ~460 MiB
# after; issue 14 measured 771 MiB, 807 MiB and 709 MiB kept before the budget)
PEAK_BOUND_MIB = 5 * BUDGET_MIB
AFTER_BOUND_MIB = 5 * BUDGET_MIB


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
                yield pb.PutRequest(header=pb.PutHeader(key=f"s{i}", size=ENTRY_MIB * MiB),
                                    data=blobs[i % 4][:4 * MiB])
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
    codes2, peak2 = arun(stalled())
    assert set(codes2) <= {C.DEADLINE_EXCEEDED, C.RESOURCE_EXHAUSTED}, set(codes2)
    assert codes2.count(C.DEADLINE_EXCEEDED) == BUDGET_MIB // ENTRY_MIB, codes2
    arun(asyncio.sleep(0.5))
    after = rss_mib(pid)
    print(f"segcache RSS MiB: base {base:.0f}, peak concurrent {peak:.0f}, between {mid:.0f} "
          f"({codes.count(C.OK)} of {N} stored), peak stalled {peak2:.0f}, after {after:.0f}")
    assert peak - base < PEAK_BOUND_MIB and peak2 - base < PEAK_BOUND_MIB, (base, peak, peak2)
    assert after - base < AFTER_BOUND_MIB, (base, after)

    async def budget_is_free_again():
        async with SegcacheClient(srv.target) as c:
            assert (await c.put("again", blobs[0])).created
    arun(budget_is_free_again())
    assert srv.alive()
