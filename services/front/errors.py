"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the status an
OpenAI client expects, and the mapping from the SDK's typed gRPC errors."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from hypic import errors as sdk

# status -> OpenAI error type
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable",
         504: "timeout"}


class ApiError(Exception):
    """An error answered to the client as JSON with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_sdk(err: sdk.HypicError) -> ApiError:
    """The HTTP error for a router's gRPC status."""
    details = err.details or str(err)
    if isinstance(err, sdk.InvalidArgument):
        if "max_prompt_tokens" in details or "at most" in details and "tokens" in details:
            return ApiError(400, details, param="messages", code="context_length_exceeded")
        return ApiError(400, details)
    if isinstance(err, sdk.ResourceExhausted):
        return ApiError(429, details, code="overloaded")
    if isinstance(err, sdk.Unavailable):
        return ApiError(503, f"no router available: {details}", code="unavailable")
    if isinstance(err, sdk.DeadlineExceeded):
        return ApiError(504, details, code="timeout")
    return ApiError(500, details, code=err.code.name.lower() if err.code else None)
