"""How the SDK connects to a router: TLS and API-key credentials, call metadata, and the
options of its channel (message sizes, reconnect backoff, balancing over a dns:/// target).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hypic.targets import balancing_options

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"


@dataclass
class Credentials:
    """How the SDK proves itself to a router (docs/security.md). tls_ca: verify the router's
    certificate against this CA (PEM path; tls=True without it uses the system roots);
    tls_cert/tls_key: a client certificate, for a router that demands one (mutual TLS);
    api_key: sent as "authorization: Bearer <key>" on every call."""
    tls: bool = False
    tls_ca: str | os.PathLike[str] | None = None
    tls_cert: str | os.PathLike[str] | None = None
    tls_key: str | os.PathLike[str] | None = None
    api_key: str | None = None

    @property
    def secure(self) -> bool:
        return self.tls or any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_key))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        read = lambda p: None if p is None else Path(p).read_bytes()  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.tls_ca),
                                            private_key=read(self.tls_key),
                                            certificate_chain=read(self.tls_cert))

    def metadata(self, request_id: str | None = None) -> list[tuple[str, str]]:
        md = [(REQUEST_ID_KEY, request_id)] if request_id else []
        md += [(AUTHORIZATION_KEY, f"Bearer {self.api_key}")] if self.api_key else []
        return md + trace_context()

    def open(self, address: str, options: list, *, aio: bool) -> Any:
        mod = grpc.aio if aio else grpc
        if self.secure:
            return mod.secure_channel(address, self.channel_credentials(), options=options)
        return mod.insecure_channel(address, options=options)


def trace_context() -> list[tuple[str, str]]:
    """The caller's current OpenTelemetry span as W3C traceparent/tracestate metadata, so the
    router's spans join the application's trace; nothing when opentelemetry is not installed
    or no span is current (the SDK does not need it)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000)] + balancing_options()
