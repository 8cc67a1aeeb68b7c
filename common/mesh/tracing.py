"""OpenTelemetry tracing across the mesh: off unless an OTLP endpoint is configured.

    enabled = setup_tracing("router", cfg.otlp_endpoint)   # serve(): before any channel opens
    server interceptors: [TracingServerInterceptor()] when enabled (continues the caller's trace)
    open_channel(...) adds client_interceptors(): the current span's W3C `traceparent` in metadata
    with span("router.plan", segments=3): ...              # a child of the current span
    @traced("combine.fetch")                               # the same, around a coroutine / async gen

The endpoint is the service's --otlp-endpoint (HYPIC_OTLP_ENDPOINT for the whole mesh), else the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; spans go there over
OTLP/gRPC in batches (OTEL_BSP_* tune the batching). With none, the API's no-op tracer stays in
place: span() costs a function call, and no interceptor is installed on either side.
"""
from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from common.mesh.handlers import rewrap_handler

TRACER_NAME = "hypic"
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_NAME_PREFIX = "hypic-"  # resource service.name: hypic-router, hypic-front, ...

_provider: Any = None  # the SDK TracerProvider once setup_tracing enabled tracing


def endpoint_from(configured: str | None, env: Any = None) -> str:
    """The OTLP endpoint: the service's own setting, else the standard OTEL_* variables; ''=off."""
    if configured:
        return configured
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return next((env[k] for k in ENDPOINT_ENV if env.get(k)), "")


def setup_tracing(service: str, configured: str | None = None) -> bool:
    """Export this process's spans to the OTLP endpoint (see endpoint_from) as service.name
    hypic-<service>; False (tracing off) when there is none."""
    endpoint = endpoint_from(configured)
    if not endpoint:
        return False
    # The SDK and exporter are imported only here: a mesh without tracing never loads them.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME_PREFIX + service}))
    insecure = not endpoint.startswith("https://")  # the exporter's own rule for a scheme-less one
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    install(provider)
    return True


def install(provider: Any) -> None:
    """Make `provider` (an SDK TracerProvider) the one our spans go to, and the global one for
    libraries (the global can be set once per process; ours can be replaced, as tests do)."""
    global _provider
    _provider = provider
    if not isinstance(trace.get_tracer_provider(), type(provider)):
        trace.set_tracer_provider(provider)


def enabled() -> bool:
    return _provider is not None


def shutdown_tracing() -> None:
    """Flush the spans still batched (at a clean stop); tracing is off afterwards."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    if _provider is not None:
        return _provider.get_tracer(TRACER_NAME)
    return trace.get_tracer(TRACER_NAME)  # the API's no-op one


@contextmanager
def span(name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL, parent: Any = None,
         **attributes: Any) -> Iterator[trace.Span]:
    """A span, current inside the block, child of the current span (or of `parent`, a context)."""
    attrs = {k: v for k, v in attributes.items() if v is not None}
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=attrs) as s:
        yield s


def traced(name: str) -> Callable[[Callable], Callable]:
    """Decorate a coroutine or async-generator function: its whole run is one span `name`."""
    def wrap(fn: Callable) -> Callable:
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def gen(*args: Any, **kw: Any):
                with span(name):
                    async for item in fn(*args, **kw):
                        yield item
            return gen

        @functools.wraps(fn)
        async def coro(*args: Any, **kw: Any):
            with span(name):
                return await fn(*args, **kw)
        return coro
    return wrap


# ---- the W3C trace context in gRPC metadata and HTTP headers -------------------------------------

def inject(carrier: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """The current trace context as (key, value) pairs (traceparent, tracestate), appended to
    `carrier`; none when there is no current span."""
    found: dict[str, str] = {}
    propagate.inject(found)
    return list(carrier or []) + list(found.items())


def extract(pairs: Any) -> otel_context.Context:
    """The caller's context from gRPC metadata or HTTP headers (any iterable of pairs, or a
    mapping)."""
    items = pairs.items() if hasattr(pairs, "items") else (pairs or ())
    return propagate.extract({str(k).lower(): v for k, v in items if isinstance(v, str)})


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call, named after the method (hypic.v1.Segcache/Get), continuing the
    caller's trace from its traceparent metadata; an error status is recorded on the span."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        name = handler_call_details.method.lstrip("/")
        parent = extract(handler_call_details.invocation_metadata)

        def wrap(behavior: Callable | None) -> Callable | None:
            if behavior is None:
                return None
            if inspect.isasyncgenfunction(behavior):
                async def gen_wrapper(request_or_iterator, context):
                    with span(name, trace.SpanKind.SERVER, parent, **{"rpc.system": "grpc"}):
                        async for item in behavior(request_or_iterator, context):
                            yield item
                return gen_wrapper
            if inspect.iscoroutinefunction(behavior):
                async def coro_wrapper(request_or_iterator, context):
                    with span(name, trace.SpanKind.SERVER, parent, **{"rpc.system": "grpc"}):
                        return await behavior(request_or_iterator, context)
                return coro_wrapper
            return behavior  # sync handlers run in grpc's executor, outside the caller's context

        return rewrap_handler(handler, wrap)


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = inject(list(details.metadata or ()))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                      details.credentials, details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What open_channel adds to a channel while tracing is on: the current context goes with
    every call (no client span: the callee's SERVER span is the caller's current span's child)."""
    if not enabled():
        return []
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
