"""Who may call what: bearer API keys (router, and the OpenAI front through `bearer_ok`) and the
writer role on segcache.

    ApiKeyInterceptor(key)                       # every RPC but health needs "authorization: Bearer key"
    WriterRoleInterceptor("hypic.v1.Segcache", read_methods={...}, writer_names={"scatter", "combine"},
                          write_token=token, tls=cfg.tls_on)
    bearer_ok(request.headers.get("authorization"), key)   # an HTTP front's check, same rule

The writer role is proven by the client certificate's common name (mutual TLS) or by the write
token in `x-hypic-write-token` metadata. Every method of the guarded service that is not a read is
a write (default deny: an RPC added later is writer-only until it is declared a read).
Refusals: no credential or a wrong token UNAUTHENTICATED, a known identity without the role
PERMISSION_DENIED. Secrets are compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
import inspect
from dataclasses import field, fields
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Optional

import grpc

from common.mesh.abort import Abort
from common.mesh.handlers import rewrap_handler

AUTHORIZATION_KEY = "authorization"
WRITE_TOKEN_KEY = "x-hypic-write-token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"

# check(metadata, context) -> None to let the call through, or the Abort that refuses it.
Check = Callable[[Mapping[str, str], Any], Optional[Abort]]


def read_secret(value: str | None) -> str | None:
    """A secret given as a value, or as "@/path/to/file" (a mounted secret; trailing newline
    stripped). Empty means none."""
    if value is None or not value.strip():
        return None
    if value.startswith("@"):
        text = Path(value[1:]).read_text().strip()
        if not text:
            raise ValueError(f"secret file {value[1:]} is empty")
        return text
    return value


def secrets_equal(given: str | None, expected: str) -> bool:
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """True when an Authorization value is "Bearer <api_key>" (scheme case-insensitive)."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets_equal(token.strip(), api_key)


def peer_common_names(context: Any) -> list[str]:
    """The subject common names of the client's verified certificate ([] without mutual TLS)."""
    try:
        ctx = context.auth_context() or {}
    except Exception:  # no security context on a plaintext call
        return []
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            for v in ctx.get("x509_common_name", [])]


def _metadata(handler_call_details: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in handler_call_details.invocation_metadata or ():
        if isinstance(v, str):
            out.setdefault(k.lower(), v)
    return out


def guard(handler: grpc.RpcMethodHandler, check: Check, metadata: Mapping[str, str]) -> grpc.RpcMethodHandler:
    """`handler` with `check` run before its behaviour (which a refusal never reaches)."""
    async def refuse_or_none(context: Any) -> None:
        refusal = check(metadata, context)
        if refusal is not None:
            await refusal.send(context)

    def wrap(behavior: Callable | None) -> Callable | None:
        if behavior is None:
            return None
        if inspect.isasyncgenfunction(behavior):
            async def gen(request, context):
                await refuse_or_none(context)
                async for item in behavior(request, context):
                    yield item
            return gen

        async def coro(request, context):
            await refuse_or_none(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        return coro

    return rewrap_handler(handler, wrap)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC except grpc.health.v1 needs `authorization: Bearer <api_key>` (UNAUTHENTICATED)."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    def check(self, metadata: Mapping[str, str], context: Any) -> Abort | None:
        if bearer_ok(metadata.get(AUTHORIZATION_KEY), self.api_key):
            return None
        return Abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required "
                     "(metadata authorization: Bearer <key>)")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        return guard(handler, self.check, _metadata(handler_call_details))


class WriterRoleInterceptor(grpc.aio.ServerInterceptor):
    """Writes to `service` (its methods not in `read_methods`) only from the writer role.

    Open only when neither mutual TLS nor a write token is configured (a plaintext dev mesh on
    loopback; the service logs a warning at start)."""

    def __init__(self, service: str, *, read_methods: Collection[str], writer_names: Collection[str],
                 write_token: str | None, mutual_tls: bool):
        self.prefix = f"/{service}/"
        self.read_methods = frozenset(read_methods)
        self.writer_names = frozenset(writer_names)
        self.write_token = write_token
        self.mutual_tls = mutual_tls

    @property
    def open(self) -> bool:
        return not self.mutual_tls and not self.write_token

    def is_write(self, method: str) -> bool:
        return method.startswith(self.prefix) and method[len(self.prefix):] not in self.read_methods

    def check(self, metadata: Mapping[str, str], context: Any) -> Abort | None:
        if self.open:
            return None
        names = peer_common_names(context) if self.mutual_tls else []
        if self.writer_names.intersection(names):
            return None
        token = metadata.get(WRITE_TOKEN_KEY)
        if self.write_token and secrets_equal(token, self.write_token):
            return None
        if token:
            return Abort(grpc.StatusCode.UNAUTHENTICATED, "invalid write token")
        if names:
            return Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{names[0]!r} does not have the writer role")
        return Abort(grpc.StatusCode.UNAUTHENTICATED, "writes need the writer role "
                     "(a writer's client certificate or the write token)")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.is_write(handler_call_details.method):
            return handler
        return guard(handler, self.check, _metadata(handler_call_details))


# ---- config fields (one definition for every service that has them) -------------------------------
def api_key_field() -> Any:
    return field(default=None, metadata={
        "help": "clients must send 'authorization: Bearer <key>' (health checks exempt); "
                "@FILE reads it from a file", "shared_env": True, "secret": True})


def write_token_field(role: str) -> Any:
    return field(default=None, metadata={"help": role + "; @FILE reads it from a file",
                                         "shared_env": True, "secret": True})


def check_secrets(cfg: Any) -> None:
    """Read every secret field of a config once (OSError/ValueError when an @FILE is unreadable
    or empty), so that a bad secret stops the service at start rather than at its first write."""
    for f in fields(cfg):
        if f.metadata.get("secret"):
            read_secret(getattr(cfg, f.name))
