"""segcache as a real server process on 127.0.0.1 (ephemeral port) with a real LMDB in tmp_path."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import urllib.request
from pathlib import Path

import grpc
import lmdb
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.mesh.nixl_util import load_nixl
from common.mesh.segcache_client import SegcacheClient, checksum
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from tests.support.segcache_process import arun, code_of

KiB, MiB = 1 << 10, 1 << 20

pytestmark = [pytest.mark.timeout(120), pytest.mark.processes]


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def nixl_ok() -> bool:
    return load_nixl()[0] is not None


# ---- byte-exact round trips --------------------------------------------------------------
def test_put_lookup_get_byte_exact_grpc_and_nixl(launch) -> None:
    if not nixl_ok():
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    srv = launch("--host-bytes", "16MiB", "--disk-bytes", "64MiB", "--max-message-bytes", "4MiB",
                 "--metrics-port", "0", "--log-level", "debug")
    sizes = {"one": 1, "small": 1000, "odd": 123_457, "multi": 3 * MiB + 17, "big": 9 * MiB + 1}
    data = {k: blob(n, i) for i, (k, n) in enumerate(sizes.items())}

    async def run():
        async with SegcacheClient(srv.target, max_message_bytes=4 * MiB) as sc:
            for k, v in data.items():
                r = await sc.put(k, v, recompute_cost_s=0.25, token_count=len(v) % 1000,
                                 model_fingerprint="fp-test", chunk_bytes=1 * MiB,
                                 request_id=f"rid-{k}")
                assert r.created and r.entry.size == len(v) and r.entry.checksum == checksum(v)
            infos = await sc.lookup([*data, "absent"])
            assert [i.key for i in infos] == [*data, "absent"]
            for i in infos[:-1]:
                assert i.tier == segcache_pb.TIER_HOST and i.size == sizes[i.key]
                assert i.recompute_cost_s == 0.25 and i.model_fingerprint == "fp-test"
            assert infos[-1].tier == segcache_pb.TIER_MISS
            for k, v in data.items():
                assert bytes(await sc.get(k)) == v
                assert bytes(await sc.get(k, chunk_bytes=64 * KiB)) == v
            assert await sc.get("absent") is None
            ok, why = await sc.nixl_available()
            assert ok, why
            out = np.zeros(16 * MiB, dtype=np.uint8)
            for k, v in data.items():
                assert (await sc.get_via_nixl(k)).tobytes() == v
                assert (await sc.get_via_nixl(k, out=out)).tobytes() == v
            assert await sc.get_via_nixl("absent") is None
            # Concurrent Puts of one key are idempotent: exactly one creates it.
            same = blob(2 * MiB, 99)
            rs = await asyncio.gather(*(sc.put("same", same, recompute_cost_s=0.1) for _ in range(6)))
            assert sum(r.created for r in rs) == 1
            assert len({r.entry.checksum for r in rs}) == 1
            assert bytes(await sc.get("same")) == same
            st = await sc.stats()
            assert st.nixl_available and st.leases_active == 0 and st.entries == len(data) + 1
        return st

    st = arun(run())
    assert st.tiers[1].hits >= 4 * len(data)
    # Prometheus endpoint: per-tier metrics and RPC latency histograms.
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    assert 'hypic_segcache_hits_total{tier="host"}' in body
    assert 'hypic_segcache_bytes{tier="disk"}' in body
    assert 'hypic_rpc_latency_seconds_bucket{code="OK",le="0.001",method="Put",service="segcache"}' in body
    assert 'method="Get"' in body and 'code="NOT_FOUND"' in body
    # The request id from metadata is bound into the server's log lines.
    assert '"request_id": "rid-multi"' in srv.log()


def test_nixl_reads_from_disk_after_restart(launch) -> None:
    """After a restart entries are on disk only; a NIXL lease promotes and serves them."""
    if not nixl_ok():
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    srv = launch("--no-nixl")
    v = blob(2 * MiB + 3, 11)

    async def put():
        async with SegcacheClient(srv.target) as sc:
            await sc.put("k", v, recompute_cost_s=1.0)
    arun(put())
    assert srv.terminate() == 0
    srv = launch("--lease-ttl-s", "0.5", name="restarted")

    async def read():
        async with SegcacheClient(srv.target) as sc:
            assert (await sc.lookup(["k"]))[0].tier == segcache_pb.TIER_DISK
            got = await sc.get_via_nixl("k")
            assert got.tobytes() == v
            assert (await sc.lookup(["k"]))[0].tier == segcache_pb.TIER_HOST
            # A lease the reader never releases ends by itself after lease_ttl_s.
            lease = await sc.stub.OpenNixlLease(segcache_pb.OpenNixlLeaseRequest(key="k", reader_agent_name="x"))
            assert lease.entry.size == len(v) and len(lease.descriptors) == 1
            assert lease.region_metadata and lease.ttl_s == 0.5
            assert (await sc.stats()).leases_active == 1
            await asyncio.sleep(1.5)
            assert (await sc.stats()).leases_active == 0
            rel = await sc.stub.ReleaseNixlLease(segcache_pb.ReleaseNixlLeaseRequest(lease_id=lease.lease_id))
            assert not rel.released
    arun(read())


# ---- budgets and policy over gRPC ------------------------------------------------------------
def test_budgets_hold_over_1000_random_puts_and_gdsf_order(launch) -> None:
    # uploads in flight may hold 1 MiB (16 at once of up to 24 KiB): this test is about the tiers
    srv = launch("--no-nixl", "--no-lmdb-sync", "--host-bytes", "256KiB", "--disk-bytes", "1MiB",
                 "--upload-budget-bytes", "1MiB")
    rng = random.Random(7)

    async def run():
        async with SegcacheClient(srv.target) as sc:
            sem = asyncio.Semaphore(16)

            async def one(i: int):
                j = rng.randrange(1200)
                async with sem:
                    await sc.put(f"k{j}", blob(1 + (j * 7919) % (24 * KiB), j),
                                 recompute_cost_s=rng.random(), send_checksum=False)
            await asyncio.gather(*(one(i) for i in range(1000)))
            st = await sc.stats()
            host, disk = st.tiers[1], st.tiers[2]
            assert 0 < host.peak_bytes <= 256 * KiB and 0 < disk.peak_bytes <= 1 * MiB
            assert host.bytes <= 256 * KiB and disk.bytes <= 1 * MiB
            assert host.evictions > 0 and disk.evictions > 0
            # Eviction order follows GDSF: the costly entry put first survives in host memory,
            # where LRU would have evicted it (it is the least recently used).
            await sc.delete([f"k{j}" for j in range(1200)])
            v = 60 * KiB
            await sc.put("costly", blob(v, 1), recompute_cost_s=30.0)
            for i in range(5):
                await sc.put(f"cheap{i}", blob(v, 2 + i), recompute_cost_s=0.001)
            tiers = {e.key: e.tier for e in await sc.lookup(["costly"] + [f"cheap{i}" for i in range(5)])}
            assert tiers["costly"] == segcache_pb.TIER_HOST, tiers
            assert tiers["cheap0"] == segcache_pb.TIER_DISK, tiers
    arun(run())


# ---- crash safety --------------------------------------------------------------------------
def test_kill9_during_put_stream_then_restart(launch) -> None:
    srv = launch("--no-nixl", "--host-bytes", "64MiB", "--disk-bytes", "256MiB")
    acked: dict[str, bytes] = {}
    attempted: dict[str, bytes] = {}

    async def writer(sc: SegcacheClient, wid: int, stop: asyncio.Event):
        i = 0
        while not stop.is_set():
            key = f"w{wid}-{i}"
            data = blob(16 * KiB + (i * 7717 + wid * 131) % (400 * KiB), wid * 100_000 + i)
            attempted[key] = data
            try:
                r = await sc.put(key, data, recompute_cost_s=0.1, chunk_bytes=64 * KiB, timeout=10)
            except grpc.aio.AioRpcError:
                return
            assert r.created
            acked[key] = data
            i += 1

    async def run():
        stop = asyncio.Event()
        async with SegcacheClient(srv.target) as sc:
            tasks = [asyncio.create_task(writer(sc, w, stop)) for w in range(4)]
            while len(acked) < 40:
                await asyncio.sleep(0.01)
            os.kill(srv.proc.pid, signal.SIGKILL)  # mid-stream: puts are in flight
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            stop.set()

    arun(run())
    srv.proc.wait(timeout=10)
    assert srv.proc.returncode == -signal.SIGKILL
    unacked = {k: v for k, v in attempted.items() if k not in acked}
    assert unacked, "the kill should interrupt at least one Put"
    print(f"kill -9 after {len(acked)} acknowledged puts, {len(unacked)} in flight")
    srv = launch("--no-nixl", "--host-bytes", "64MiB", "--disk-bytes", "256MiB", name="restarted")

    async def verify():
        async with SegcacheClient(srv.target) as sc:
            for k, v in acked.items():  # every acknowledged Put is there and verifies
                got = await sc.get(k)  # the client checks the checksum too
                assert got is not None and bytes(got) == v, k
            for k, v in unacked.items():  # in-flight ones: whole or absent, never partial
                got = await sc.get(k)
                assert got is None or bytes(got) == v, k
            st = await sc.stats()
            assert st.corrupt_dropped == 0
            assert len(acked) <= st.entries <= len(acked) + len(unacked)
    arun(verify())


def test_flipped_bytes_in_lmdb_value_is_a_miss_and_gone(launch, tmp_path: Path) -> None:
    srv = launch("--no-nixl")
    good, bad = blob(300 * KiB, 1), blob(300 * KiB, 2)

    async def put():
        async with SegcacheClient(srv.target) as sc:
            await sc.put("good", good, recompute_cost_s=1.0)
            await sc.put("bad", bad, recompute_cost_s=1.0)
    arun(put())
    assert srv.terminate() == 0  # graceful SIGTERM exit

    env = lmdb.open(str(srv.data_dir), max_dbs=4)
    db = env.open_db(b"data")
    with env.begin(write=True, db=db) as txn:
        v = bytearray(txn.get(b"bad"))
        for pos in (100, len(v) // 2, len(v) - 1):  # inside the payload
            v[pos] ^= 0xFF
        txn.put(b"bad", bytes(v))
    env.close()

    srv = launch("--no-nixl", name="restarted")

    async def read():
        async with SegcacheClient(srv.target) as sc:
            assert (await sc.lookup(["bad"]))[0].tier == segcache_pb.TIER_DISK
            assert await sc.get("bad") is None  # NOT_FOUND: a miss, never the bad bytes
            assert (await sc.lookup(["bad"]))[0].tier == segcache_pb.TIER_MISS
            assert await sc.get("bad") is None
            assert bytes(await sc.get("good")) == good
            st = await sc.stats()
            assert st.corrupt_dropped == 1 and st.entries == 1
    arun(read())
    assert srv.terminate() == 0
    env = lmdb.open(str(srv.data_dir), max_dbs=4, readonly=True)
    with env.begin(db=env.open_db(b"data", create=False)) as txn:
        assert txn.get(b"bad") is None and txn.get(b"good") is not None
    env.close()


# ---- malformed requests ------------------------------------------------------------------
def test_malformed_requests_get_clear_status_and_service_stays_up(launch) -> None:
    srv = launch("--no-nixl", "--host-bytes", "1MiB", "--disk-bytes", "4MiB",
                 "--max-message-bytes", "256KiB")
    C = grpc.StatusCode

    async def run():
        async with SegcacheClient(srv.target, max_message_bytes=4 * MiB) as sc:
            stub = sc.stub

            async def put_raw(*msgs):
                return await stub.Put(iter(msgs), timeout=10)

            hdr = lambda **kw: segcache_pb.PutHeader(**{"key": "k", "size": 3, "recompute_cost_s": 0.1, **kw})
            cases = {
                "lookup empty key": (sc.lookup([""]), C.INVALID_ARGUMENT),
                "lookup no keys": (sc.lookup([]), C.INVALID_ARGUMENT),
                "lookup too many": (sc.lookup(["k"] * 5000), C.INVALID_ARGUMENT),
                "get empty key": (sc.get(""), C.INVALID_ARGUMENT),
                "put empty key": (sc.put("", b"abc"), C.INVALID_ARGUMENT),
                "put long key": (sc.put("k" * 300, b"abc"), C.INVALID_ARGUMENT),
                "put oversize": (put_raw(segcache_pb.PutRequest(header=hdr(size=2 * MiB))), C.RESOURCE_EXHAUSTED),
                "put zero size": (put_raw(segcache_pb.PutRequest(header=hdr(size=0))), C.INVALID_ARGUMENT),
                "put no header": (put_raw(segcache_pb.PutRequest(data=b"abc")), C.INVALID_ARGUMENT),
                "put empty stream": (put_raw(), C.INVALID_ARGUMENT),
                "put short": (put_raw(segcache_pb.PutRequest(header=hdr(), data=b"ab")), C.INVALID_ARGUMENT),
                "put long": (put_raw(segcache_pb.PutRequest(header=hdr(), data=b"abcd")), C.INVALID_ARGUMENT),
                "put two headers": (put_raw(segcache_pb.PutRequest(header=hdr(), data=b"a"),
                                            segcache_pb.PutRequest(header=hdr(), data=b"bc")), C.INVALID_ARGUMENT),
                "put nan cost": (put_raw(segcache_pb.PutRequest(header=hdr(recompute_cost_s=float("nan")), data=b"abc")),
                                 C.INVALID_ARGUMENT),
                "put bad checksum": (put_raw(segcache_pb.PutRequest(header=hdr(checksum=checksum(b"xyz")), data=b"abc")),
                                     C.DATA_LOSS),
                "message over limit": (sc.put("big", bytes(300 * KiB), chunk_bytes=300 * KiB), C.RESOURCE_EXHAUSTED),
                "nixl disabled": (stub.OpenNixlLease(segcache_pb.OpenNixlLeaseRequest(key="k"), timeout=10),
                                  C.FAILED_PRECONDITION),
                "delete empty key": (sc.delete([""]), C.INVALID_ARGUMENT),
                "pin no keys": (sc.pin([]), C.INVALID_ARGUMENT),
            }
            got = {name: await code_of(coro) for name, (coro, _) in cases.items()}
            want = {name: code for name, (_, code) in cases.items()}
            assert got == want
            assert (await sc.stats()).entries == 0  # nothing partial was stored
            r = await sc.put("k", b"abc")
            assert r.created and bytes(await sc.get("k")) == b"abc"
    arun(run())

    # 10 MB of garbage on the raw TCP port, twice (with and without an HTTP/2 preface).
    rng = random.Random(3)
    for prefix in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.settimeout(10)
            try:
                s.sendall(prefix)
                for _ in range(10):
                    s.sendall(rng.randbytes(1_000_000))
            except OSError:
                pass  # the server may hang up first: that is fine
    assert srv.alive()

    async def still_up():
        async with grpc.aio.insecure_channel(srv.target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="hypic.v1.Segcache"), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        async with SegcacheClient(srv.target) as sc:
            assert bytes(await sc.get("k")) == b"abc"
    arun(still_up())
    assert srv.terminate() == 0
