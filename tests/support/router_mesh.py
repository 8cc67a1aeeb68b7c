"""A router run as a process against neighbours that fail in chosen ways, and how tests talk to
it. Combine and scatter are not needed: the router is pointed at refused, black-hole or hung
combine / segcache / scatter addresses, and at a real segcache process for lookups. What the router
decided (hits, misses, workers) is read from its JSON log lines."""

from __future__ import annotations

import json
import time

import grpc

from hypic.launcher import Service
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from tests.support.peers import BlackHole, HungHttp2, closed_port
from tests.support.tiny import make_tiny_model


def log_events(svc: Service, event: str, request_id: str | None = None) -> list[dict]:
    out = []
    for line in svc.log().splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == event and (request_id is None or d.get("request_id") == request_id):
            out.append(d)
    return out


def wait_log(svc: Service, event: str, request_id: str, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = log_events(svc, event, request_id)
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {event!r} log line for {request_id}:\n{svc.log_tail()}")


def router_mesh(tmp_path_factory):
    """segcache (real) and two routers:
    A: combines [refused port, black hole], scatter workers on refused ports, the real segcache;
    B: a hung combine (HTTP/2 up, never answers), a black-hole segcache, max_in_flight 2."""
    base = tmp_path_factory.mktemp("router")
    model = make_tiny_model(base / "model")
    hole_c, hole_s, hung = BlackHole(), BlackHole(), HungHttp2()
    run, logs = base / "run", base / "logs"
    seg = Service("segcache", "segcache", ["--data-dir", str(base / "lmdb"), "--host-bytes",
                                           "16MiB", "--disk-bytes", "64MiB", "--no-nixl"],
                  run, logs)
    seg.start()
    seg.wait_ready(time.monotonic() + 60)
    common = ["--model", str(model), "--log-level", "debug", "--load-poll-s", "0.2"]
    ra = Service("routerA", "router", common + [
        "--combine-addresses", f"127.0.0.1:{closed_port()},{hole_c.address}",
        "--segcache-address", seg.address,
        "--scatter-addresses", f"127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}",
        "--max-prompt-tokens", "64", "--metrics-port", "0"], run, logs)
    rb = Service("routerB", "router", common + [
        "--combine-addresses", hung.address, "--segcache-address", hole_s.address,
        "--lookup-timeout-s", "0.3", "--max-in-flight", "2"], run, logs)
    ra.start()
    rb.start()
    try:
        deadline = time.monotonic() + 90
        ra.wait_ready(deadline)
        rb.wait_ready(deadline)
        yield {"model": model, "segcache": seg, "a": ra, "b": rb, "hole": hole_c.address}
        for svc in (ra, rb, seg):  # graceful shutdown on SIGTERM
            assert svc.stop(grace_s=15) == 0, svc.log_tail()
    finally:
        for svc in (ra, rb, seg):
            svc.stop(grace_s=5)
        for h in (hole_c, hole_s, hung):
            h.close()


def stub(svc: Service) -> router_grpc.RouterStub:
    return router_grpc.RouterStub(grpc.insecure_channel(svc.address))


def call(svc: Service, req: router_pb.GenerateRequest, timeout: float = 10.0,
         rid: str | None = None) -> tuple[grpc.StatusCode, str, float]:
    md = [("x-request-id", rid)] if rid else None
    t = time.monotonic()
    try:
        list(stub(svc).Generate(req, timeout=timeout, metadata=md))
    except grpc.RpcError as e:
        return e.code(), e.details(), time.monotonic() - t
    return grpc.StatusCode.OK, "", time.monotonic() - t


def seg(text: str = "", ids=()) -> router_pb.Segment:
    return router_pb.Segment(text=text, token_ids=list(ids))
