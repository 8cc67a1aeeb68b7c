"""The grpc.aio server every Hypic service runs.

    server, port, health = build_server("segcache", host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes)
    add_MyServicer_to_server(servicer, server)
    await server.start()
    await mark_serving(health, "hypic.v1.Segcache")
    await wait_for_shutdown_signal()
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)

run(main_coro) runs the event loop (uvloop when importable).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.mesh.channels import message_options
from common.mesh.guard import GuardInterceptor
from common.mesh.handlers import rewrap_handler
from common.mesh.log import request_id_from_metadata
from common.mesh.metrics import RPC_LATENCY, RPC_TOTAL

DEFAULT_HOST = "127.0.0.1"
OVERALL = grpc_health.OVERALL_HEALTH  # "" : the whole server


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _code_name(context: Any, default: str) -> str:
    try:
        code = context.code()
    except Exception:  # older grpc: no accessor
        code = None
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    # The code label stays within grpc.StatusCode's names (a bounded label set, issue 30).
    return _CODE_NAMES.get(code, "UNKNOWN")


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):
    """Binds request_id / rpc into structlog contextvars and records latency and status code."""

    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        rid = request_id_from_metadata(handler_call_details.invocation_metadata)
        service = self.service

        def finish(context: Any, start: float, default: str) -> None:
            code = _code_name(context, default)
            RPC_LATENCY.labels(service, method, code).observe(time.perf_counter() - start)
            RPC_TOTAL.labels(service, method, code).inc()

        def wrap(behavior: Callable | None) -> Callable | None:
            if behavior is None:
                return None
            if inspect.isasyncgenfunction(behavior):
                async def gen_wrapper(request_or_iterator, context):
                    start = time.perf_counter()
                    default = "UNKNOWN"
                    with structlog.contextvars.bound_contextvars(request_id=rid, rpc=method):
                        try:
                            async for item in behavior(request_or_iterator, context):
                                yield item
                            default = "OK"
                        except asyncio.CancelledError:
                            default = "CANCELLED"
                            raise
                        finally:
                            finish(context, start, default)
                return gen_wrapper
            if inspect.iscoroutinefunction(behavior):
                async def coro_wrapper(request_or_iterator, context):
                    start = time.perf_counter()
                    default = "UNKNOWN"
                    with structlog.contextvars.bound_contextvars(request_id=rid, rpc=method):
                        try:
                            result = await behavior(request_or_iterator, context)
                            default = "OK"
                            return result
                        except asyncio.CancelledError:
                            default = "CANCELLED"
                            raise
                        finally:
                            finish(context, start, default)
                return coro_wrapper
            return behavior  # sync handlers run in grpc's executor; left as they are

        return rewrap_handler(handler, wrap)


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def build_server(service: str, *, host: str = DEFAULT_HOST, port: int = 0,
                 max_message_bytes: int = 4 << 20,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 options: Sequence[tuple[str, Any]] = (),
                 credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int, Any]:
    """A grpc.aio server bound to host:port (port 0: ephemeral), with grpc.health.v1 registered
    (every service NOT_SERVING until mark_serving), TLS when `credentials` are given (then
    there is no plaintext port). Returns (server, bound_port, health)."""
    defaults = message_options(max_message_bytes) + [
        # A second process must not silently share the port (grpc enables SO_REUSEPORT).
        ("grpc.so_reuseport", 0),
    ]
    # `options` replace the defaults of the same name rather than trail them: which of two
    # equal keys grpc-core takes is its own affair.
    opts = list({**dict(defaults), **dict(options)}.items())
    server = grpc.aio.server(interceptors=[ObservabilityInterceptor(service), GuardInterceptor(), *interceptors],
                             options=opts)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = format_address(host, port)
    bound = (server.add_secure_port(address, credentials) if credentials is not None
             else server.add_insecure_port(address))
    if not bound:
        raise OSError(f"could not bind {format_address(host, port)}")
    return server, bound, health


async def mark_serving(health: Any, *service_names: str) -> None:
    for name in (OVERALL, *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)


SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def wait_for_shutdown_signal(signals: Sequence[int] = SHUTDOWN_SIGNALS,
                                   timeout_s: float | None = None) -> int | None:
    """Wait until one of `signals` arrives; returns its number (None once timeout_s passed)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    for sig in signals:
        loop.add_signal_handler(sig, lambda s=sig: fut.done() or fut.set_result(int(s)))
    try:
        if timeout_s is None:
            return await fut
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)
        return fut.result() if done else None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def shutdown(server: grpc.aio.Server, health: Any, *, grace_s: float = 5.0,
                   drain_s: float = 0.0) -> None:
    """Drain, then stop: health NOT_SERVING at once (load balancers and the router stop sending
    new calls) while calls are still served for drain_s; then stop accepting calls and let the
    running ones finish for grace_s. A second SIGTERM/SIGINT during the drain ends it early --
    and, the handlers being ours until then, never kills the process with the signal."""
    await health.enter_graceful_shutdown()
    if drain_s > 0:
        log = structlog.get_logger("server")
        log.info("draining", drain_s=drain_s)
        sig = await wait_for_shutdown_signal(timeout_s=drain_s)
        log.info("drained", cut_short_by_signal=sig)
    await server.stop(grace_s)


def write_port_file(path: str | os.PathLike[str] | None, **info: Any) -> None:
    """Atomically write `info` as JSON (e.g. port, metrics_port, pid) for whoever started us."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


PARENT_PID_ENV = "HYPIC_PARENT_PID"


def die_with_parent_from_env() -> None:
    """When a launcher set HYPIC_PARENT_PID, end this process (SIGTERM) when that parent dies.

    Done here, after exec, rather than in a preexec_fn: a preexec_fn runs between fork and exec
    in a copy of a multi-threaded parent (torch, grpc) and can deadlock on a lock some other
    thread held at fork time, hanging the parent's Popen forever."""
    want = os.environ.get(PARENT_PID_ENV)
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(want):  # the parent died before we armed the signal
        os.kill(os.getpid(), signal.SIGTERM)


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run main() on uvloop when available, else the default asyncio loop."""
    die_with_parent_from_env()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
