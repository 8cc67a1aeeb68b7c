"""A Get that says where its reader is (segcache.proto's ReaderPlace), on CPU.

1. A real segcache process and the real client: without a device tier (no CUDA here), a reader
   with a place, on this box or another, gets the host path: the bytes, exactly as a Get without
   a place (old clients), and every answer is counted by path (hypic_segcache_reads_total).
2. The servicer in this process over a store whose tier 0 is a CPU stand-in and an IPC export
   stand-in (CUDA's cannot run here): a reader on the same box and GPU gets a device lease, which
   keeps the entry in tier 0 until the reader releases it or its TTL passes; every other reader,
   and one that requires checked seals from a segcache without the secret, gets the bytes.
The CUDA IPC read itself is scripts/gpu_tier.py's "combine fetch over CUDA IPC" row.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest

from common.mesh.segcache_client import SegcacheClient
from common.mesh.transfer_path import box_id, reader_place_pb
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.segcache.device_reads import READS
from services.segcache.store import TIER_DEVICE
from tests.support.device_tier import GPU, blob, place, serve, stand_in_servicer
from tests.support.segcache_process import arun

KiB = 1 << 10


def reads_by_path(body: str) -> dict[str, float]:
    out = {}
    for line in body.splitlines():
        if line.startswith("hypic_segcache_reads_total{"):
            out[line.split('path="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_readers_with_a_place_get_the_host_path_and_old_clients_are_unchanged(launch) -> None:
    srv = launch("--host-bytes", "4MiB", "--disk-bytes", "16MiB", "--metrics-port", "0", "--no-nixl")
    data = blob(300 * KiB + 7, 1)

    async def run():
        async with SegcacheClient(srv.target) as sc:
            await sc.put("k", data, recompute_cost_s=0.5)
            old_info, old = await sc.get_with_info("k")  # no place: the Get of before
            here = await sc.get_at_place("k", reader_place_pb("cpu", requires_sealed=False), chunk_bytes=64 * KiB)
            away = await sc.get_at_place("k", place("another-box", "GPU-x"))
            same_box = await sc.get_at_place("k", place(box_id(), "GPU-x"))  # this segcache has no GPU
            missing = await sc.get_at_place("absent", place(box_id(), "GPU-x"))
            released = await sc.release_device("no-such-lease")
        return old_info, old, [here, away, same_box], missing, released

    old_info, old, placed, missing, released = arun(run())
    assert bytes(old) == data and old_info.tier == segcache_pb.TIER_HOST
    for got in placed:
        assert got.device is None or not got.device.lease_id
        assert bytes(got.data) == data and got.info == old_info
    assert missing is None and released is False
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    counted = reads_by_path(body)
    assert counted["host"] == 4.0 and counted.get("ipc", 0.0) == 0.0


# ---- the device lease, in this process ---------------------------------------------------------
@pytest.fixture
def served(tmp_path: Path):
    yield from stand_in_servicer(tmp_path)


def test_a_same_gpu_reader_gets_a_device_lease_until_it_releases_it(served) -> None:
    servicer, store = served
    data = blob(20 * KiB, 2)

    async def run():
        server, target = await serve(servicer)
        try:
            async with SegcacheClient(target) as sc:
                await sc.put("k", data)
                assert (await sc.lookup(["k"]))[0].tier == segcache_pb.TIER_DEVICE
                got = await sc.get_at_place("k", place(box_id(), GPU))
                assert got.data is None and got.device.lease_id and got.device.ttl_s == 0.5
                assert got.device.ipc.nbytes == len(data) and len(got.device.ipc.handle) == 64
                assert got.info.size == len(data) and got.info.tier == segcache_pb.TIER_DEVICE
                held = store.leases_active
                assert await sc.release_device(got.device.lease_id) is True
                assert await sc.release_device(got.device.lease_id) is False  # once
                others = [await sc.get_at_place("k", p) for p in (
                    place("another-box", GPU), place(box_id(), "GPU-other"), place(box_id(), GPU, ipc=False),
                    place(box_id(), GPU, sealed=True))]  # no secret here: its seals were not checked
                return held, others, store.leases_active
        finally:
            await server.stop(None)

    before = READS.labels("ipc")._value.get()
    held, others, after = arun(run())
    assert held == 1 and after == 0
    assert all(o.device is None or not o.device.lease_id for o in others)
    assert all(bytes(o.data) == data for o in others)
    assert READS.labels("ipc")._value.get() == before + 1
    assert store.tier_of("k") == TIER_DEVICE


def test_an_unreleased_device_lease_ends_at_its_ttl_and_pins_the_entry_until_then(tmp_path: Path) -> None:
    # a TTL the 8 filler Puts below fit in on a loaded machine (0.5 s did not: about 1 s a Put)
    ttl_s = 4.0
    stand_in = stand_in_servicer(tmp_path, lease_ttl_s=ttl_s)
    servicer, store = next(stand_in)

    async def run():
        server, target = await serve(servicer)
        try:
            async with SegcacheClient(target) as sc:
                await sc.put("k", blob(20 * KiB, 3))
                got = await sc.get_at_place("k", place(box_id(), GPU))
                assert got.device.lease_id
                pinned = store.leases_active
                for i in range(8):  # would push "k" out of a 64 KiB tier 0 if it were not leased
                    await sc.put(f"filler-{i}", blob(20 * KiB, 10 + i))
                still = store.tier_of("k")
                t0 = time.monotonic()
                while store.leases_active and time.monotonic() - t0 < ttl_s + 5:
                    await asyncio.sleep(0.05)
                return got.device.lease_id, pinned, still, store.leases_active, time.monotonic() - t0
        finally:
            await server.stop(None)

    try:
        lease_id, pinned, still, after, waited = arun(run())
        assert pinned == 1 and still == TIER_DEVICE
        assert after == 0 and waited < ttl_s + 5
        assert servicer.device_leases.release(lease_id) is False  # expired: unknown now
    finally:
        stand_in.close()
