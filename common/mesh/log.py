"""structlog JSON logging and the per-request id.

setup_logging() configures structlog to write one JSON object per line (to stderr by default)
with timestamp, level, service, event and whatever is bound in structlog's contextvars. The
server interceptor in common.mesh.server binds `request_id` (from the `x-request-id` metadata
key, or a fresh id) and `rpc` for the duration of each call, so every log line a handler writes
carries them.

Libraries log through the stdlib `logging` module (grpc, asyncio, uvicorn, nixl, transformers,
`warnings`): a root handler renders their records with structlog's ProcessorFormatter, the same
processors in front (`foreign_pre_chain`) and the same renderer, so their lines are the same JSON
objects, with `logger` (the stdlib logger's name) added. Libraries that install their own console
handler (nixl, transformers) are made to propagate to it instead: adopt_library_loggers(), run
again after such a library is imported. Output of C code (grpc core under GRPC_VERBOSITY, UCX)
does not pass through Python and stays plain text.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from typing import Any, Iterable, TextIO

import structlog

REQUEST_ID_KEY = "x-request-id"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}

# uvicorn's access log record: logger.info('%s - "%s %s HTTP/%s" %d', client, method, path,
# http_version, status); the arguments become fields of the line.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class StructlogHandler(logging.StreamHandler):
    """The root handler setup_logging installs (a class of its own so a second setup replaces
    it, and adopt_library_loggers leaves it alone)."""


def setup_logging(service: str, level: str = "info", *, json: bool = True,
                  stream: TextIO | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog and stdlib logging (process-wide); return a logger bound with
    `service`."""
    lvl = level_number(level)
    out = stream or sys.stderr
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)

    def add_service(_logger: Any, _name: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    shared = [structlog.contextvars.merge_contextvars, add_service,
              structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # WriteLogger writes each line, newline included, in one write() call, as the stdlib
        # handler does (print() writes the newline apart): our lines and the libraries' lines
        # on the same stream never interleave within a line.
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Libraries are chatty at info (grpc, asyncio, uvicorn's lifecycle): WARNING and above,
    # unless debugging.
    route_stdlib_logging(out, lvl if lvl <= logging.DEBUG else max(lvl, logging.WARNING), shared,
                         renderer)
    return structlog.get_logger(service)


def level_number(level: str) -> int:
    """The stdlib level of a --log-level name (debug, info, warning/warn, error, critical)."""
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ValueError(f"unknown log level {level!r}")
    return lvl


def route_stdlib_logging(out: TextIO, level: int, pre_chain: list, renderer: Any) -> None:
    """Render every stdlib log record through `pre_chain` + `renderer` onto `out`."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*pre_chain, structlog.stdlib.add_logger_name, foreign_fields],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
        pass_foreign_args=True)
    handler = StructlogHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StructlogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn(...) -> the py.warnings logger -> here
    adopt_library_loggers()


def foreign_fields(_logger: Any, _name: str, event: dict) -> dict:
    """A foreign-chain processor: drop the record's positional arguments, but first make
    uvicorn's access-log arguments fields of the line; strip the newline warnings end with."""
    event["event"] = str(event.get("event", "")).rstrip()
    args = event.pop("positional_args", ())
    record = event.get("_record")
    if (record is not None and record.name == "uvicorn.access" and isinstance(args, tuple)
            and len(args) == len(_ACCESS_FIELDS)):
        event.update(zip(_ACCESS_FIELDS, args))
    return event


def adopt_library_loggers() -> None:
    """Make every logger that prints on its own (a console StreamHandler of a library, e.g.
    nixl's on stdout, transformers' on stderr) propagate to the root handler instead. Call
    again after importing such a library; levels are left as the library set them."""
    console_streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):  # a PlaceHolder
            continue
        console = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
                   and not isinstance(h, (logging.FileHandler, StructlogHandler))
                   and getattr(h, "stream", None) in console_streams]
        for h in console:
            logger.removeHandler(h)
        if console:
            logger.propagate = True


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


class OncePer:
    """Lets one log line through per key (a client connection, say) per `interval_s`, so that a
    client sending the same bad traffic many times fills no log (issue 30). Keeps at most
    `max_keys` keys, the oldest forgotten first: memory stays bounded however many clients come.
    Used from one event loop (no lock)."""

    def __init__(self, interval_s: float = 60.0, max_keys: int = 1024):
        self.interval_s, self.max_keys = interval_s, max_keys
        self._last: dict[str, tuple[float, int]] = {}  # key -> (time logged, suppressed since)

    def allow(self, key: str) -> int | None:
        """None when this key logged within the interval (counted); else how many lines were
        suppressed since its last one (0 the first time)."""
        now = time.monotonic()
        last = self._last.pop(key, None)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        while len(self._last) >= self.max_keys:
            del self._last[next(iter(self._last))]
        self._last[key] = (now, 0)
        return last[1] if last is not None else 0


class OncePerMessage(logging.Filter):
    """A logging filter that lets each of `messages` through once per `interval_s` (all clients
    together; the others pass untouched): for a library's per-connection warnings about client
    errors, which carry no peer to key on ("Invalid HTTP request received.")."""

    def __init__(self, messages: Iterable[str], interval_s: float = 10.0):
        super().__init__()
        self.messages = frozenset(messages)
        self.once = OncePer(interval_s=interval_s, max_keys=len(self.messages) + 1)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return msg not in self.messages or self.once.allow(msg) is not None
