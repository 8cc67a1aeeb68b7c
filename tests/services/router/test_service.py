"""The router as a process (tests/support/router_mesh.py: a real segcache and two routers whose
combines, scatters or segcache are refused, black holes or hung): its contract with clients,
clean statuses for bad input, deadlines, load shedding, cancellation, health and metrics."""

from __future__ import annotations

import asyncio
import random
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.engine.fingerprint import model_fingerprint, segment_key
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from tests.support.peers import closed_port
from tests.support.router_mesh import call, log_events, seg, stub, wait_log

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]


def test_info_and_fingerprint_contract(mesh) -> None:
    info = stub(mesh["a"]).Info(router_pb.InfoRequest(), timeout=5)
    fp = model_fingerprint(mesh["model"])
    assert info.model_fingerprint == fp == mesh["a"].info["fingerprint"]
    assert info.vocab_size == 512 and info.model_type == "qwen3_5_text"
    assert info.seam == 8 and info.dtype == "float32" and info.max_prompt_tokens == 64
    assert info.segcache_address == mesh["segcache"].address
    assert len(info.scatter_addresses) == 2 and len(info.combine_addresses) == 2
    # The engine (scatter, combine) reads the same checkpoint as the same fingerprint.
    from common.engine.hybrid_engine import HybridEngine
    assert HybridEngine.from_pretrained(Path(mesh["model"])).fingerprint == fp


@pytest.mark.parametrize("name,req", [
    ("no segments", router_pb.GenerateRequest(query=seg("hi"), max_tokens=1)),
    ("empty segment", router_pb.GenerateRequest(segments=[seg("a"), seg()], query=seg("q"), max_tokens=1)),
    ("empty query", router_pb.GenerateRequest(segments=[seg("a")], max_tokens=1)),
    ("id >= vocab", router_pb.GenerateRequest(segments=[seg(ids=[1, 512])], query=seg("q"), max_tokens=1)),
    ("max_tokens 0", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=0)),
    ("over max_prompt_tokens", router_pb.GenerateRequest(segments=[seg(ids=[1] * 40), seg(ids=[2] * 20)],
                                                  query=seg(ids=[3] * 5), max_tokens=1)),
    ("text over max_prompt_tokens", router_pb.GenerateRequest(segments=[seg("alice " * 100)],
                                                       query=seg("q"), max_tokens=1)),
    ("mixed", router_pb.GenerateRequest(segments=[seg("abc", ids=[1, 2])], query=seg("q"), max_tokens=1)),
    ("unknown mode", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1, mode=9)),
    ("nan temperature", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                           temperature=float("nan"))),
    ("max_tokens over limit", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"),
                                                 max_tokens=100_000)),
    ("denormal temperature", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                                temperature=1e-45)),
    ("inf temperature", router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                           temperature=float("inf"))),
])
def test_invalid_arguments(mesh, name, req) -> None:
    code, details, dt = call(mesh["a"], req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
    assert dt < 2.0


# Field 1, length-delimited, announcing 127 bytes that never come: no message decodes from it.
UNDECODABLE = b"\x0a\x7f\x01"


def test_undecodable_bytes_are_invalid_argument_on_router_and_segcache(mesh) -> None:
    with grpc.insecure_channel(mesh["a"].address) as ch:
        gen = ch.unary_stream("/hypic.v1.Router/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(gen(UNDECODABLE, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert ch.unary_unary("/hypic.v1.Router/Info")(b"", timeout=10)  # still serving
    with grpc.insecure_channel(mesh["segcache"].address) as ch:
        for method, kind in (("Lookup", "unary_unary"), ("Get", "unary_stream"), ("Put", "stream_unary"),
                             ("Delete", "unary_unary"), ("Pin", "unary_unary")):
            rpc = getattr(ch, kind)(f"/hypic.v1.Segcache/{method}")
            arg = iter([UNDECODABLE]) if kind == "stream_unary" else UNDECODABLE
            with pytest.raises(grpc.RpcError) as e:
                out = rpc(arg, timeout=10)
                if kind == "unary_stream":
                    list(out)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())


def test_client_messages_carry_no_addresses_and_request_ids_are_ascii(mesh) -> None:
    """A non-ASCII request id is cleaned (not INTERNAL); the UNAVAILABLE answer names no internal
    address (they are in the log, under the request id)."""
    req = router_pb.GenerateRequest(segments=[seg(ids=[1, 2, 3])], query=seg(ids=[4]), max_tokens=1,
                             request_id="r\u00e9q-\u2603-\x07id")
    code, details, _ = call(mesh["a"], req, timeout=2.0)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "127.0.0.1" not in details and mesh["hole"] not in details
    assert "rq--id" in details  # the cleaned id, to find the log lines by
    assert wait_log(mesh["a"], "combine unavailable; trying the next", "rq--id")


def test_invalid_modes_share_one_metric_label(mesh) -> None:
    for mode in (9, 17, 1000, 2**31 - 1):
        code, _, _ = call(mesh["a"], router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"),
                                                         max_tokens=1, mode=mode))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    port = mesh["a"].info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    modes = {line.split('mode="', 1)[1].split('"', 1)[0] for line in text.splitlines()
             if line.startswith("hypic_router_requests_total{")}
    assert "unknown" in modes and modes <= {"unknown", "full", "prefix", "additive", "hypic"}, modes


def test_unreachable_combines_unavailable_within_deadline_and_lookup_hits_planned(mesh) -> None:
    """A real segcache holds one of two segments: the router plans 2 hits + 1 miss (assigned to
    a scatter worker), tries both combines (one refuses, one never completes a connection) and
    answers UNAVAILABLE before the client's deadline."""
    from common.mesh.segcache_client import SegcacheClient

    fp = model_fingerprint(mesh["model"])
    cached, fresh = [5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]
    key = segment_key(fp, 8, "float32", cached)

    async def put() -> None:
        async with SegcacheClient(mesh["segcache"].address) as sc:
            await sc.put(key, b"entry-bytes", recompute_cost_s=0.1, token_count=len(cached),
                         model_fingerprint=fp)

    asyncio.run(put())
    rid = "rid-hit-plan"
    req = router_pb.GenerateRequest(segments=[seg(ids=cached), seg(ids=fresh), seg(ids=cached)],
                             query=seg("bob likes"), max_tokens=4)
    code, details, dt = call(mesh["a"], req, timeout=2.0, rid=rid)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "no combine service available" in details and dt < 2.0
    tried = {d["combine"] for d in wait_log(mesh["a"], "combine unavailable; trying the next", rid)}
    assert len(tried) == 2 and mesh["hole"] in tried
    planned = wait_log(mesh["a"], "planned", rid)[0]
    assert planned["hits"] == 2 and planned["misses"] == 1 and len(planned["workers"]) == 1
    assert planned["prompt_tokens"] > 2 * len(cached) + len(fresh)  # + the tokenized query
    # ADDITIVE keys use seam 0, so the seam-8 entry is not a hit there; FULL does no lookup.
    for mode, rid2, hits in ((router_pb.PREFILL_MODE_ADDITIVE, "rid-additive", 0),
                             (router_pb.PREFILL_MODE_FULL, "rid-full", None)):
        req.mode = mode
        code, _, dt = call(mesh["a"], req, timeout=1.0, rid=rid2)
        assert code == grpc.StatusCode.UNAVAILABLE and dt < 1.0
        lines = log_events(mesh["a"], "planned", rid2)
        if hits is None:
            assert lines == []
        else:
            assert lines and lines[0]["hits"] == hits and lines[0]["misses"] == 3


def test_slow_segcache_and_hung_combine(mesh) -> None:
    """Router B: segcache never answers (lookup budget 0.3 s → all misses, logged, not fatal);
    the combine accepts the call and never answers → DEADLINE_EXCEEDED at the client's deadline."""
    rid = "rid-hung"
    req = router_pb.GenerateRequest(segments=[seg("alice likes tea")], query=seg("bob"), max_tokens=2)
    code, details, dt = call(mesh["b"], req, timeout=1.5, rid=rid)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert dt < 2.5
    assert wait_log(mesh["b"], "segcache lookup failed; serving every segment as a miss", rid)
    assert wait_log(mesh["b"], "planned", rid)[0]["misses"] == 1


def test_resource_exhausted_and_cancellation(mesh) -> None:
    """max_in_flight 2: two hanging requests fill the router, a third is refused; cancelling
    the two frees the slots (the router notices the client went away)."""
    ch = grpc.insecure_channel(mesh["b"].address)
    s = router_grpc.RouterStub(ch)
    req = router_pb.GenerateRequest(segments=[seg(ids=[1, 2, 3])], query=seg(ids=[4]), max_tokens=2)
    hanging = [s.Generate(req, timeout=60) for _ in range(2)]
    time.sleep(1.0)  # both past the lookup (0.3 s) and waiting on the hung combine
    code, details, dt = call(mesh["b"], req, timeout=5)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert dt < 1.0
    for h in hanging:
        h.cancel()
    deadline = time.monotonic() + 5
    while True:  # in-flight slots come back once the router sees the cancellations
        code, details, _ = call(mesh["b"], req, timeout=1.0)
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            break
        assert time.monotonic() < deadline, "cancelled requests still hold their slots"
        time.sleep(0.1)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(log_events(mesh["b"], "request cancelled")) >= 2
    ch.close()


def test_garbage_bytes_do_not_kill_the_router(mesh) -> None:
    host, port = mesh["a"].address.rsplit(":", 1)
    junk = random.Random(1).randbytes(10 << 20)
    for payload in (junk, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + junk[: 1 << 20]):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server hung up on us: fine
    assert mesh["a"].alive()
    info = stub(mesh["a"]).Info(router_pb.InfoRequest(), timeout=5)
    assert info.vocab_size == 512
    code, _, _ = call(mesh["a"], router_pb.GenerateRequest(query=seg("x"), max_tokens=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_health_metrics_and_request_ids(mesh) -> None:
    from hypic.healthcheck import check, status

    assert check(mesh["a"].address)
    assert status(mesh["a"].address, "hypic.v1.Router") == "SERVING"
    assert status(f"127.0.0.1:{closed_port()}", timeout=0.5) == "UNAVAILABLE"
    rid = "rid-metrics-1"
    call(mesh["a"], router_pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=0), rid=rid)
    failed = wait_log(mesh["a"], "request failed", rid)[0]
    assert failed["code"] == "INVALID_ARGUMENT" and failed["service"] == "router"
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{mesh['a'].info['metrics_port']}/metrics", timeout=5).read().decode()
    assert 'hypic_router_requests_total{code="INVALID_ARGUMENT",mode="hypic"}' in body
    assert "hypic_router_cost_model" in body
    assert 'hypic_rpc_total{code="OK",method="Info",service="router"}' in body
