"""Deadlines handed down and a cost model that learns, on a real mesh
(segcache, one scatter worker, combine, router: processes on 127.0.0.1):

- combine hands its caller's remaining time down: a scatter Build and a segcache call receive
  at most what the caller has left, and Execute ends with DEADLINE_EXCEEDED at the caller's
  deadline when the peer hangs (a real gRPC server on 127.0.0.1 that never answers);
- the router's cost model learns from real builds: after cold requests its coefficients have
  moved away from the prior.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

import hypic
from common.engine.fingerprint import model_fingerprint, segment_key
from hypic.launcher import Mesh, free_port
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from protos.hypic.v1 import router_pb2 as router_pb
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 8
pytestmark = [pytest.mark.timeout(400), pytest.mark.processes]


@pytest.fixture(scope="module")
def hanging_segcache():
    """A segcache member that hangs, known to combine (a plan may name only members it knows)."""
    peer = HangingPeer()
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, hanging_segcache):
    base = tmp_path_factory.mktemp("guards-mesh")
    model = save_tiny("qwen3_5_text", base / "model", seed=7, **PIC_CONFIGS["qwen3_5_text"])
    seg_port = free_port()
    ring = f"127.0.0.1:{seg_port},{hanging_segcache.address}"  # the router's plans name the first only
    with Mesh(model, base / "data", n_scatter=1, threads=1, seam=SEAM, start_timeout_s=240,
              segcache_port=seg_port, extra_args={"router": ["--metrics-port", "0"],
                                                  "combine": ["--segcache-address", ring]}) as m:
        yield m
    assert m.exit_codes and all(c == 0 for c in m.exit_codes.values()), m.exit_codes


class HangingPeer:
    """A gRPC server on 127.0.0.1 that takes every call, notes the time the caller gave it, and
    never answers (until the caller gives up)."""

    def __init__(self):
        self.calls: list[tuple[str, float | None]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def _hang(self, method: str, context) -> None:
        with self._lock:
            self.calls.append((method.rsplit("/", 1)[-1], context.time_remaining()))
        end = time.monotonic() + 120
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.02)

    def service(self, details):  # grpc.GenericRpcHandler
        method = details.method
        if method.endswith("/NixlInfo"):  # combine's start-up probe of a segcache member: no NIXL
            return None
        if method.endswith(("/Build", "/Get")):  # server streaming
            def stream(request, context):
                self._hang(method, context)
                return iter(())
            return grpc.unary_stream_rpc_method_handler(stream)

        def unary(request, context):
            self._hang(method, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung")
        return grpc.unary_unary_rpc_method_handler(unary)

    def methods(self) -> dict[str, list[float | None]]:
        with self._lock:
            out: dict[str, list[float | None]] = {}
            for m, t in self.calls:
                out.setdefault(m, []).append(t)
            return out

    def close(self) -> None:
        self.server.stop(0)


@pytest.fixture
def hanging_peer():
    peer = HangingPeer()
    yield peer
    peer.close()


def plan(mesh: Mesh, segs, query, source, *, scatter: str, segcache: str) -> combine_pb.Plan:
    fp = model_fingerprint(mesh.model)
    return combine_pb.Plan(
        segments=[combine_pb.PlannedSegment(key=segment_key(fp, SEAM, "float32", s), token_ids=s, source=source)
                  for s in segs],
        query=query, seam=SEAM, model_fingerprint=fp, dtype="float32", mode=router_pb.PREFILL_MODE_HYPIC,
        max_tokens=2, scatter_addresses=[scatter], segcache_address=segcache, store_entries=False)


def execute(address: str, p: combine_pb.Plan, timeout_s: float) -> tuple[grpc.StatusCode, float]:
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        try:
            list(combine_grpc.CombineStub(ch).Execute(p, timeout=timeout_s))
        except grpc.RpcError as e:
            return e.code(), time.monotonic() - t0
    return grpc.StatusCode.OK, time.monotonic() - t0


@pytest.mark.parametrize("peer_role", ["scatter", "segcache"])
def test_combine_passes_the_callers_remaining_time_downstream(mesh, hanging_peer, hanging_segcache,
                                                             peer_role, fresh_seed) -> None:
    g = random.Random(fresh_seed)
    segs = [[g.randrange(1, 500) for _ in range(n)] for n in (30, 12)]
    if peer_role == "scatter":  # misses go to a scatter worker that hangs
        p = plan(mesh, segs, [3, 4], combine_pb.SOURCE_SCATTER, scatter=hanging_peer.address,
                 segcache=mesh.segcache_address)
        watched = {"Build"}
    else:  # planned hits, from a segcache that hangs (and a hanging scatter for the rebuild)
        p = plan(mesh, segs, [3, 4], combine_pb.SOURCE_SEGCACHE, scatter=hanging_peer.address,
                 segcache=hanging_segcache.address)
        watched = {"Lookup", "Get", "Build"}  # (NixlInfo: a background probe, no request's)
    caller_s = 5.0  # under combine's own caps (segcache_timeout_s 10, default 300); room to connect
    code, took = execute(mesh.addresses["combine0"], p, caller_s)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, code
    assert took < caller_s + 3.0  # promptly: not combine's own 10 s / 300 s
    calls = {**hanging_segcache.methods(), **hanging_peer.methods()}  # Lookup/Get, Build
    seen = {m: ts for m, ts in calls.items() if m in watched}
    assert seen, calls
    for m, ts in seen.items():
        for t in ts:
            # 50 ms of slack: the grpc-timeout header is rounded up to its unit (the mutant hands on 10 s+)
            assert t is not None and t <= caller_s + 0.05, (m, t)
    # combine is free again at once: a request that needs nothing from the hung peer succeeds
    ok = plan(mesh, [segs[0]], [5], combine_pb.SOURCE_LOCAL, scatter=hanging_peer.address, segcache="")
    assert execute(mesh.addresses["combine0"], ok, 60)[0] == grpc.StatusCode.OK


def cost_metrics(mesh: Mesh) -> tuple[dict[str, float], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{mesh['router'].info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    coefs, observations = {}, 0.0
    for line in body.splitlines():
        if line.startswith("hypic_router_cost_model{"):
            coefs[line.split('coef="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("hypic_router_cost_observations_total "):
            observations = float(line.split()[-1])
    return coefs, observations


def test_router_cost_model_learns_from_real_builds(mesh, fresh_seed) -> None:
    prior, seen0 = cost_metrics(mesh)
    g = random.Random(fresh_seed)
    with hypic.Client(mesh.router_address, timeout=120) as c:
        for lengths in ((40, 90), (150, 20, 60)):
            segs = [[g.randrange(1, 500) for _ in range(n)] for n in lengths]
            res = c.generate(segments=segs, query=[7, 8], max_tokens=1, stream=False)
            assert [t.source for t in res.timings.trace] == ["scatter"] * len(segs)
    deadline = time.monotonic() + 10
    while True:
        coefs, seen = cost_metrics(mesh)
        if seen >= seen0 + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert seen >= seen0 + 5, (seen0, seen)
    moved = {k: abs(coefs[k] - prior[k]) / max(abs(prior[k]), 1e-12) for k in prior}
    assert max(moved.values()) > 0.01, (prior, coefs)
