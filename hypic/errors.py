"""Typed exceptions of the Hypic SDK, one per gRPC status the router can answer with.

    try:
        client.generate(segments=[...], query="...", max_tokens=16, stream=False)
    except hypic.errors.InvalidArgument as e:     # also a ValueError
        print(e.details)
    except hypic.errors.Unavailable:              # also a ConnectionError
        ...
    except hypic.errors.HypicError as e:          # every other status
        print(e.code, e.request_id)
"""

from __future__ import annotations

from typing import Any

import grpc


class HypicError(Exception):
    """Base of every SDK error. `code` is the grpc.StatusCode (None for client-side errors),
    `details` the server's message, `request_id` the request it belongs to (when known)."""

    code: grpc.StatusCode | None = None

    def __init__(self, details: str = "", *, code: grpc.StatusCode | None = None,
                 request_id: str = ""):
        if code is not None:
            self.code = code
        self.details = details
        self.request_id = request_id
        name = self.code.name if self.code is not None else type(self).__name__
        msg = f"{name}: {details}" if details else name
        if request_id:
            msg += f" (request {request_id})"
        super().__init__(msg)


class InvalidArgument(HypicError, ValueError):
    """The request is malformed (no segments, empty segment, bad token ids, too long...)."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(HypicError):
    """The router has too many requests in flight (or a cache budget is exhausted): retry later."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(HypicError, ConnectionError):
    """The router, or every combine service behind it, cannot be reached."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(HypicError, TimeoutError):
    """The request's timeout passed."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(HypicError):
    code = grpc.StatusCode.CANCELLED


class NotFound(HypicError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(HypicError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(HypicError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(HypicError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(HypicError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(HypicError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(HypicError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(HypicError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(HypicError):
    code = grpc.StatusCode.INTERNAL


class DataLoss(HypicError):
    code = grpc.StatusCode.DATA_LOSS


class Unknown(HypicError):
    code = grpc.StatusCode.UNKNOWN


BY_CODE: dict[grpc.StatusCode, type[HypicError]] = {
    cls.code: cls for cls in (InvalidArgument, ResourceExhausted, Unavailable, DeadlineExceeded,
                              Cancelled, NotFound, AlreadyExists, PermissionDenied,
                              Unauthenticated, FailedPrecondition, Aborted, OutOfRange,
                              Unimplemented, Internal, DataLoss, Unknown)
}


def from_rpc_error(err: Any, request_id: str = "") -> HypicError:
    """The typed exception for a grpc.RpcError / grpc.aio.AioRpcError."""
    try:
        code = err.code()
        details = err.details() or ""
    except Exception:  # not a call-like error
        return Unknown(str(err), request_id=request_id)
    cls = BY_CODE.get(code, HypicError)
    if cls is HypicError:
        return HypicError(details, code=code, request_id=request_id)
    return cls(details, request_id=request_id)


__all__ = ["HypicError", "from_rpc_error", "BY_CODE", *[c.__name__ for c in BY_CODE.values()]]
