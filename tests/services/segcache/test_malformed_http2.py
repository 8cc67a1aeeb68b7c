"""HTTP/2 streams opened and reset at once on a real segcache (issue 30: 500 HEADERS + RST_STREAM
pairs on one connection logged ~140 "unhandled error in handler" errors with gRPC tracebacks):
the server stays up and answers, and logs at most one warning per connection, no traceback."""
from __future__ import annotations

import time

import pytest

from common.mesh.segcache_client import SegcacheClient
from tests.support.raw_traffic import http2_reset_storm
from tests.support.segcache_process import arun

pytestmark = pytest.mark.timeout(180)
CONNECTIONS, PAIRS = 3, 500


@pytest.mark.processes
@pytest.mark.parametrize("method", ["Put", "Get", "Lookup"])
def test_reset_streams_log_at_most_one_warning_per_connection(launch, method: str) -> None:
    srv = launch("--no-nixl", "--no-lmdb-sync", "--host-bytes", "16MiB", "--disk-bytes", "64MiB")
    start = len(srv.log().splitlines())
    answers = [http2_reset_storm(srv.port, f"/hypic.v1.Segcache/{method}", PAIRS)
               for _ in range(CONNECTIONS)]
    time.sleep(0.5)
    lines = srv.log().splitlines()[start:]
    assert all(answers), "the server answered each connection (SETTINGS at least)"
    problems = [ln for ln in lines if '"level": "error"' in ln or "Traceback" in ln]
    assert not problems, (len(problems), problems[:2])
    assert len([ln for ln in lines if '"level": "warning"' in ln]) <= CONNECTIONS, lines[:5]

    async def still_serving():
        async with SegcacheClient(srv.target) as c:
            assert (await c.put("after", b"x" * 1000)).created
            assert await c.get("after") == b"x" * 1000
    arun(still_serving())
