"""segcache serves before its NIXL agent exists (LeaseManager(agent_in_background=True), issue
29): Get/Put answer at once, NixlInfo waits for the agent within its deadline or answers
UNAVAILABLE, and NIXL reads work once the agent is made."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from common.mesh.nixl_util import load_nixl
from common.mesh.segcache_client import SegcacheClient
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.segcache.config import SegcacheConfig
from services.segcache.nixl_agent import LeaseManager
from services.segcache.servicer import SegcacheServicer
from services.segcache.store import SegmentStore
from tests.support.device_tier import serve

KiB = 1 << 10


@pytest.fixture
def servicer(tmp_path):
    if load_nixl()[0] is None:
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    cfg = SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, host_bytes=1 << 20,
                         disk_bytes=4 << 20)
    store = SegmentStore(cfg)
    executor = ThreadPoolExecutor(2)
    leases = LeaseManager(store, agent_in_background=True)
    yield SegcacheServicer(cfg, store, leases, executor)
    leases.close()
    store.close()
    executor.shutdown()


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_serves_before_the_agent_and_reads_over_nixl_after(servicer):
    value = np.random.default_rng(3).integers(0, 256, 300 * KiB, dtype=np.uint8).tobytes()

    async def run():
        server, target = await serve(servicer)
        try:
            async with SegcacheClient(target) as sc:
                assert (await sc.put("k", value, recompute_cost_s=0.1)).created
                assert bytes(await sc.get("k")) == value
                st = await sc.stats()
                assert not st.nixl_available and st.nixl_reason == "nixl agent starting"
                assert await _code(sc.stub.NixlInfo(segcache_pb.NixlInfoRequest(), timeout=0.5)) \
                    == grpc.StatusCode.UNAVAILABLE
                assert await _code(sc.stub.OpenNixlLease(segcache_pb.OpenNixlLeaseRequest(
                    key="k", reader_agent_name="r"), timeout=0.5)) == grpc.StatusCode.UNAVAILABLE
                assert servicer.leases.starting
                servicer.leases.start_agent()
                ok, why = await sc.nixl_available()  # waits for the agent being made
                assert ok, why
                assert (await sc.get_via_nixl("k")).tobytes() == value
                assert (await sc.stats()).nixl_available
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_closing_while_the_agent_is_made_waits_for_it(servicer):
    servicer.leases.start_agent()
    servicer.leases.close()  # joins the maker, then closes the agent it made
    assert servicer.leases.agent_made.is_set() and not servicer.leases.available
    assert servicer.leases.reason == "closed"
