"""The one error a servicer raises to end a call with a gRPC status.

Raised anywhere below an RPC handler (validation, a failed peer, the engine thread) and turned into
`context.abort(code, details)` once, at the handler, so that bad input always reaches the client as
a clean status rather than an internal error.
"""
from __future__ import annotations

from typing import Any, NoReturn

import grpc


class Abort(Exception):
    """End the current call with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details

    @classmethod
    def invalid(cls, details: str) -> "Abort":
        """Bad input: INVALID_ARGUMENT."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, details)

    async def send(self, context: Any) -> NoReturn:
        """End the call on `context` (grpc.aio raises out of this)."""
        await context.abort(self.code, self.details)
        raise AssertionError("context.abort returned")  # pragma: no cover
