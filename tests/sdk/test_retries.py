"""The SDK retries only what may succeed on another try: a request the router rejected
(INVALID_ARGUMENT) reaches the router once, from the sync and the async client alike. Counted on
the router's own request counter (hypic_router_requests_total{code="INVALID_ARGUMENT"})."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

import hypic
from hypic import errors
from hypic.launcher import Mesh
from tests.support.peers import HungHttp2
from tests.support.tiny import make_tiny_model

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

BAD_TOKEN = 99_999  # outside the tiny model's vocabulary: the router rejects the request


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """segcache + router; the combine is a hung HTTP/2 peer (no request here gets that far)."""
    base = tmp_path_factory.mktemp("retries")
    hung = HungHttp2()
    m = Mesh(make_tiny_model(base / "model"), base / "data", n_scatter=0, n_combine=0,
             external_combine=[hung.address],
             extra_args={"router": ["--metrics-port", "0"],
                         "segcache": ["--host-bytes", "16MiB", "--disk-bytes", "64MiB", "--no-nixl"]},
             start_timeout_s=120, grace_s=10)
    with m:
        yield m
    hung.close()


def rejected_count(mesh) -> float:
    port = mesh["router"].info["metrics_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = 'hypic_router_requests_total{code="INVALID_ARGUMENT",mode="hypic"} '
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(want))


def settled_count(mesh, before: float, settle_s: float = 1.5) -> float:
    """The counter once no retry is on its way (gRPC's backoff starts at 0.1 s, at most 1 s)."""
    time.sleep(settle_s)
    return rejected_count(mesh) - before


def test_invalid_argument_reaches_the_router_once(mesh) -> None:
    before = rejected_count(mesh)
    with hypic.Client(mesh.router_address, timeout=20) as c:
        with pytest.raises(errors.InvalidArgument, match="vocabulary"):
            c.generate(segments=[[1, 2, BAD_TOKEN]], query=[3], max_tokens=2, stream=False)
    assert settled_count(mesh, before) == 1

    before = rejected_count(mesh)

    async def run() -> None:
        async with hypic.AsyncClient(mesh.router_address, timeout=20) as c:
            with pytest.raises(errors.InvalidArgument, match="vocabulary"):
                async for _ in c.generate(segments=[[1, 2, BAD_TOKEN]], query=[3], max_tokens=2,
                                          stream=True):
                    pass

    asyncio.run(run())
    assert settled_count(mesh, before) == 1
