"""structlog JSON logging and the per-request id.

setup_logging() configures structlog to write one JSON object per line (to stderr by default)
with timestamp, level, service, event and whatever is bound in structlog's contextvars. The
server interceptor in common.rpc.server binds `request_id` (from the `x-request-id` metadata
key, or a fresh id) and `rpc` for the duration of each call, so every log line a handler writes
carries them.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any, Iterable, TextIO

import structlog

REQUEST_ID_KEY = "x-request-id"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


def setup_logging(service: str, level: str = "info", *, json: bool = True,
                  stream: TextIO | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog (process-wide) and return a logger bound with `service`."""
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    def add_service(_logger: Any, _name: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging (grpc, nixl) go to the same stream, plain text.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=stream or sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return structlog.get_logger(service)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def request_id_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The caller's x-request-id (sanitised, at most 64 chars), or a fresh id."""
    for k, v in metadata or ():
        if k == REQUEST_ID_KEY:
            v = sanitize_request_id(v)
            if v:
                return v
    return new_request_id()


def sanitize_request_id(value: Any) -> str:
    """A caller's request id as Hypic may log it and pass on in metadata: printable ASCII only
    (gRPC metadata values must be ASCII), at most 64 characters; "" when nothing is left."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return "".join(c for c in str(value) if " " <= c <= "~")[:64]
