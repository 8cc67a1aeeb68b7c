"""common/mesh/tracing.py in one process: off by default, and with an SDK provider (its in-memory
exporter) a trace continues across real gRPC calls -- unary and streaming -- through the server
interceptor and the channels open_channel makes, with the parent links of the call chain."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.mesh import tracing
from common.mesh.channels import open_channel
from common.mesh.server import build_server
from hypic.credentials import Credentials

SERVICE = "test.Echo"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.shutdown_tracing()


def test_off_without_an_endpoint(monkeypatch) -> None:
    for name in tracing.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    assert tracing.endpoint_from(None, env={}) == ""
    assert tracing.endpoint_from("", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://c:4317"
    assert tracing.endpoint_from("http://mine:4317", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == "http://mine:4317"
    assert tracing.endpoint_from(None, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                            "OTEL_SDK_DISABLED": "true"}) == ""
    assert tracing.setup_tracing("test", "") is False
    assert not tracing.enabled() and tracing.client_interceptors() == []
    with tracing.span("nothing") as s:  # the API's no-op span: nothing to propagate
        assert not s.get_span_context().is_valid
        assert tracing.inject() == []


def test_w3c_context_round_trips_through_headers(spans) -> None:
    with tracing.span("caller") as caller:
        headers = dict(tracing.inject())
        sdk_metadata = dict(Credentials(api_key="k").metadata("rid"))
    ctx = caller.get_span_context()
    assert headers["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    assert sdk_metadata["traceparent"] == headers["traceparent"]  # the SDK carries it too
    with tracing.span("callee", parent=tracing.extract({"TraceParent": headers["traceparent"]})) as callee:
        assert callee.parent.span_id == ctx.span_id
        assert callee.get_span_context().trace_id == ctx.trace_id
    assert dict(Credentials().metadata()) == {}  # outside any span: nothing added


def _echo_handlers(address: list[str]) -> grpc.GenericRpcHandler:
    """Unary: opens a span and calls Stream on the same server (a hop with our channel)."""
    async def unary(request: bytes, context) -> bytes:
        if request == b"fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad input")
        with tracing.span("inner"):
            async with open_channel(address[0]) as ch:
                call = ch.unary_stream(f"/{SERVICE}/Stream")(request)
                parts = [p async for p in call]
        return b"".join(parts)

    async def stream(request: bytes, context):
        for b in request:
            yield bytes([b])

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})


async def _call_through_server(payload: bytes) -> bytes:
    address: list[str] = []
    server, port, _ = build_server("test", interceptors=[tracing.TracingServerInterceptor()])
    server.add_generic_rpc_handlers([_echo_handlers(address)])
    address.append(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with open_channel(address[0]) as ch:
            with tracing.span("client"):
                return await ch.unary_unary(f"/{SERVICE}/Unary")(payload, timeout=10)
    finally:
        await server.stop(None)


def test_a_trace_follows_the_calls(spans) -> None:
    assert tracing.enabled() and len(tracing.client_interceptors()) == 4
    assert asyncio.run(_call_through_server(b"abc")) == b"abc"
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"client", f"{SERVICE}/Unary", "inner", f"{SERVICE}/Stream"}
    chain = [by_name[n] for n in ("client", f"{SERVICE}/Unary", "inner", f"{SERVICE}/Stream")]
    assert len({s.context.trace_id for s in chain}) == 1
    assert chain[0].parent is None
    for parent, child in zip(chain, chain[1:]):
        assert child.parent is not None and child.parent.span_id == parent.context.span_id, child.name
    assert by_name[f"{SERVICE}/Unary"].kind == trace.SpanKind.SERVER
    assert by_name[f"{SERVICE}/Stream"].kind == trace.SpanKind.SERVER


def test_a_failed_call_is_an_error_span(spans) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_call_through_server(b"fail"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the status is the handler's, unchanged
    (server_span,) = [s for s in spans.get_finished_spans() if s.name == f"{SERVICE}/Unary"]
    assert server_span.status.status_code == trace.StatusCode.ERROR


def test_traced_wraps_coroutines_and_async_generators(spans) -> None:
    @tracing.traced("coro")
    async def coro(x: int) -> int:
        return x + 1

    @tracing.traced("gen")
    async def gen(n: int):
        for i in range(n):
            with tracing.span("step"):
                yield i

    async def main() -> tuple[int, list[int]]:
        return await coro(1), [i async for i in gen(2)]

    assert asyncio.run(main()) == (2, [0, 1])
    finished = spans.get_finished_spans()
    assert sorted(s.name for s in finished) == ["coro", "gen", "step", "step"]
    (gen_span,) = [s for s in finished if s.name == "gen"]
    assert all(s.parent.span_id == gen_span.context.span_id for s in finished if s.name == "step")
