"""The server interceptor that makes every RPC end in a clean status, whatever the input.

- Request bytes that do not decode as the RPC's message end the call with INVALID_ARGUMENT
  (grpc's own answer is UNKNOWN "Unexpected <class DecodeError>", or INTERNAL on a stream):
  the deserializer hands back an `Undecodable` marker instead of raising, and the wrapped
  handler aborts when it meets one (unary: before the servicer runs; streams: at that message).
- An `Abort` a handler lets escape is sent as its status.
- Any other exception is logged with the request id and answered INTERNAL with a message that
  names only the request id: exception text and internal addresses stay in the log.

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

log = structlog.get_logger("rpc.guard")


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


async def _fail(context: Any, exc: BaseException, method: str) -> None:
    """End the call for an exception a handler let escape (never returns)."""
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
            try:
                request = await prepare(request, context)
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                if _passes(e):
                    raise
                await _fail(context, e, method)
        return gen
    if inspect.iscoroutinefunction(behavior):
        async def coro(request: Any, context: Any):
            try:
                request = await prepare(request, context)
                return await behavior(request, context)
            except BaseException as e:
                if _passes(e):
                    raise
                await _fail(context, e, method)
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
