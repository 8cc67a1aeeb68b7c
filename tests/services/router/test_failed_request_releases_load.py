"""The router gives back what a request reserved: after a request whose combine
fails, the load its misses put on the scatter workers is gone (a leaked ticket would keep the
workers looking busy, and a later request for the same keys would join builds nobody runs).

Runs on the router tests' mesh (tests/support/router_mesh.py: a real segcache, router A whose
combines all fail)."""

from __future__ import annotations

import random
import time
import urllib.request

import grpc
import pytest

from protos.hypic.v1 import router_pb2 as router_pb
from tests.support.router_mesh import call, seg

pytestmark = pytest.mark.processes


def worker_loads(svc) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{svc.info['metrics_port']}/metrics",
                                  timeout=5).read().decode()
    return {line.split('worker="')[1].split('"')[0]: float(line.split()[-1])
            for line in body.splitlines() if line.startswith("hypic_router_worker_load_seconds{")}


def test_failed_request_gives_its_worker_load_back(mesh, fresh_seed) -> None:
    g = random.Random(fresh_seed)
    segs = [[g.randrange(1, 500) for _ in range(n)] for n in (20, 9, 25)]  # max_prompt_tokens 64
    req = router_pb.GenerateRequest(segments=[seg(ids=s) for s in segs], query=seg(ids=[3, 4]), max_tokens=2)
    for attempt in range(2):  # the same keys again: planned afresh, and given back again
        code, details, _ = call(mesh["a"], req, timeout=5.0, rid=f"rid-release-{fresh_seed}-{attempt}")
        assert code == grpc.StatusCode.UNAVAILABLE, details
        deadline = time.monotonic() + 3
        while any(worker_loads(mesh["a"]).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        loads = worker_loads(mesh["a"])
        assert loads and all(v == 0 for v in loads.values()), loads
