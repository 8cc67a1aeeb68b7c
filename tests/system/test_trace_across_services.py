"""One request, one trace, five services: a mesh with the front, every process exporting its spans
over OTLP/gRPC to a real collector endpoint this test runs on 127.0.0.1 (opentelemetry-proto's
TraceService, decoding what arrives). The request carries our own W3C traceparent; the spans that
come back must all be in that trace, from front, router, combine, scatter and segcache, each
hop's server span the child of a span of the service that called it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from hypic.launcher import Mesh

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
SERVICES = {"hypic-front", "hypic-router", "hypic-combine", "hypic-scatter", "hypic-segcache"}


class Collector(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span exported to it, as dicts of the fields we check."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request: otlp_pb.ExportTraceServiceRequest, context) -> otlp_pb.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans += [{"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                    "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "kind": s.kind} for s in ss.spans]
        return otlp_pb.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Collector()
    otlp_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, f"http://127.0.0.1:{port}"
    server.stop(None)


# The spans one request must leave. Each service exports in batches, and a server span ends (and
# is exported) after the spans inside it: wait for all of them, not for a first span per service.
WANTED = [("hypic-front", "POST /v1/completions"), ("hypic-router", "hypic.v1.Router/Generate"),
          ("hypic-router", "router.lookup"), ("hypic-router", "router.plan"),
          ("hypic-combine", "hypic.v1.Combine/Execute"), ("hypic-combine", "combine.fetch"),
          ("hypic-combine", "combine.compose"), ("hypic-combine", "combine.decode"),
          ("hypic-scatter", "hypic.v1.Scatter/Build"), ("hypic-scatter", "scatter.build")]


def wait_for_services(sink: Collector, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = sink.trace(TRACE_ID)
        names = {(s["service"], s["name"]) for s in spans}
        if {s["service"] for s in spans} >= SERVICES and set(WANTED) <= names:
            return spans
        time.sleep(0.2)
    return sink.trace(TRACE_ID)


def test_one_request_is_one_trace_across_all_five_services(collector, tmp_path) -> None:
    sink, endpoint = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    prompt = "alpha beta gamma delta epsilon # # zeta eta theta iota kappa # # what"
    with Mesh(None, tmp_path, n_scatter=1, threads=1, front=True, env=env) as mesh:
        r = httpx.post(f"{mesh.front_url}/v1/completions", timeout=120,
                       headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"},
                       json={"model": "hypic-tiny-qwen35", "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
        spans = wait_for_services(sink)
    by_id = {s["id"]: s for s in spans}
    names = {(s["service"], s["name"]) for s in spans}
    assert {s["service"] for s in spans} == SERVICES, sorted(names)
    for want in WANTED:
        assert want in names, (want, sorted(names))
    # every span hangs off another span of this trace, the front's request span off the caller's
    # (fastapi adds spans of its own under it)
    for s in spans:
        if (s["service"], s["name"]) == ("hypic-front", "POST /v1/completions"):
            assert s["parent"] == CALLER_SPAN_ID, s
        else:
            assert s["parent"] in by_id, s
    callers = {"hypic-router": {"hypic-front"}, "hypic-combine": {"hypic-router"},
               "hypic-scatter": {"hypic-combine"},
               "hypic-segcache": {"hypic-router", "hypic-combine", "hypic-scatter"}}
    for s in spans:
        if s["kind"] == 2 and s["service"] in callers:  # SPAN_KIND_SERVER: an incoming call
            assert by_id[s["parent"]]["service"] in callers[s["service"]], (s, by_id[s["parent"]])
    (fetch, *_) = [s for s in spans if s["name"] == "combine.fetch"]
    assert by_id[fetch["parent"]]["name"] == "combine.compose"
