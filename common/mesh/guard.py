"""The server interceptor that makes every RPC end in a clean status, whatever the input.

- Request bytes that do not decode as the RPC's message end the call with INVALID_ARGUMENT
  (grpc's own answer is UNKNOWN "Unexpected <class DecodeError>", or INTERNAL on a stream):
  the deserializer hands back an `Undecodable` marker instead of raising, and the wrapped
  handler aborts when it meets one (unary: before the servicer runs; streams: at that message).
- An `Abort` a handler lets escape is sent as its status.
- Any other exception is logged with the request id and answered INTERNAL with a message that
  names only the request id: exception text and internal addresses stay in the log.
- A call whose client is gone (it reset the stream or closed the connection: sending the status
  fails with grpc's ExecuteBatchError) is a client's doing, not an error of ours: one warning per
  client connection a minute at most, no traceback, and the call ends as grpc ends such calls
  (issue 30: 500 HEADERS + RST_STREAM pairs on one connection logged ~140 errors with tracebacks).

Sync handlers (none in Hypic) are left as they are.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator, Callable

import grpc
import structlog

from common.mesh.abort import Abort
from common.mesh.handlers import rewrap_handler
from common.mesh.log import OncePer

log = structlog.get_logger("rpc.guard")

# grpc raises this when the status cannot be sent because the client has gone; private in grpc,
# hence looked up (an exception nothing raises when grpc moves it).
ClientGone = getattr(getattr(grpc, "_cython").cygrpc, "ExecuteBatchError", type("ClientGone", (Exception,), {}))
_gone_warnings = OncePer(interval_s=60.0)


class Undecodable:
    """What the guarded deserializer returns for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def guarded_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserialize`, returning Undecodable instead of raising."""
    if deserialize is None:
        return None

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or anything a malformed message provokes
            return Undecodable(type(e).__name__)
    return safe


def _request_id() -> str:
    return str(structlog.contextvars.get_contextvars().get("request_id") or "")


def internal_details() -> str:
    """The client-facing message of an unexpected failure: the request id to look up, no more."""
    rid = _request_id()
    return f"internal error (request id {rid})" if rid else "internal error"


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # no peer once the call is torn down
        return ""


def client_gone(peer: str, exc: BaseException, method: str) -> None:
    """Note (at most once per client connection a minute) a call ended because its client left."""
    suppressed = _gone_warnings.allow(peer)
    if suppressed is not None:
        log.warning("client went away before its answer", method=method, peer=peer,
                    suppressed=suppressed, error=type(exc).__name__)


async def _fail(context: Any, exc: BaseException, method: str, peer: str) -> None:
    """End the call for an exception a handler let escape (never returns)."""
    if isinstance(exc, ClientGone):
        client_gone(peer, exc, method)
        raise exc  # grpc ends such a call quietly
    if isinstance(exc, Abort):
        await exc.send(context)
    log.error("unhandled error in handler", method=method, error=f"{type(exc).__name__}: {exc}",
              exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, internal_details())


async def _undecodable(context: Any, item: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request message does not decode ({item.error})")


async def _checked_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, Undecodable):
            await _undecodable(context, item)
        yield item


def _passes(exc: BaseException) -> bool:
    """Exceptions that must go through untouched: aborts already sent, cancellation."""
    return isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit))


def _wrap(behavior: Callable | None, streaming_request: bool, method: str) -> Callable | None:
    if behavior is None:
        return None

    async def prepare(request: Any, context: Any) -> Any:
        if streaming_request:
            return _checked_stream(request, context)
        if isinstance(request, Undecodable):
            await _undecodable(context, request)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def gen(request: Any, context: Any):
            peer = _peer(context)  # while the call is live: gone with it
            try:
                request = await prepare(request, context)
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                if _passes(e):
                    raise
                await _fail(context, e, method, peer)
        return gen
    if inspect.iscoroutinefunction(behavior):
        async def coro(request: Any, context: Any):
            peer = _peer(context)
            try:
                request = await prepare(request, context)
                return await behavior(request, context)
            except BaseException as e:
                if _passes(e):
                    raise
                await _fail(context, e, method, peer)
        return coro
    return behavior


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Clean statuses for undecodable requests and escaped exceptions (module docstring)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        return rewrap_handler(handler, lambda behavior: _wrap(behavior, handler.request_streaming, method),
                              guarded_deserializer(handler.request_deserializer))
