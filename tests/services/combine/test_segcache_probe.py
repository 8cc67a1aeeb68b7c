"""The combine's start-up NIXL probe of segcache waits for a segcache that starts after it: the
launcher starts both at once (hypic.launcher), so a refused probe is made again until segcache
answers, and one that never answers gives up after its timeout (then hits go over gRPC)."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.mesh.nixl_util import load_nixl
from hypic.processes import reserve_port
from services.combine.config import CombineConfig
from services.combine.peers import Peers
from tests.support.segcache_process import launch  # noqa: F401  (fixture)


@pytest.mark.processes
def test_probe_waits_for_a_segcache_started_after_it(launch, tmp_path):  # noqa: F811
    held = reserve_port("127.0.0.1")  # bound, not listening: connections are refused
    port = held.getsockname()[1]
    addr = f"127.0.0.1:{port}"

    async def scenario() -> tuple[bool, bool]:
        peers = Peers(CombineConfig(model=str(tmp_path)))
        try:
            probe = asyncio.ensure_future(peers.prepare(addr, timeout=60.0, retry_s=0.2))
            await asyncio.sleep(1.5)
            assert not probe.done(), "a refused probe must be retried, not given up"
            assert not peers.nixl_ready(addr)
            await asyncio.to_thread(launch, "--port", str(port))
            ok = await asyncio.wait_for(probe, 60)
            return ok, peers.nixl_ready(addr)
        finally:
            await peers.close()

    try:
        ok, ready = asyncio.run(scenario())
    finally:
        held.close()
    expected = load_nixl()[0] is not None  # without nixl the probe answers "unavailable"
    assert ok == expected and ready == expected


def test_probe_of_a_segcache_that_never_answers_gives_up_after_its_timeout(tmp_path):
    held = reserve_port("127.0.0.1")
    addr = f"127.0.0.1:{held.getsockname()[1]}"

    async def scenario() -> tuple[bool, float]:
        peers = Peers(CombineConfig(model=str(tmp_path)))
        try:
            t0 = time.monotonic()
            return await peers.prepare(addr, timeout=1.0, retry_s=0.2), time.monotonic() - t0
        finally:
            await peers.close()

    try:
        ok, took = asyncio.run(scenario())
    finally:
        held.close()
    assert ok is False and 0.6 <= took < 10, took
