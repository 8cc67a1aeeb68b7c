"""The one entry point of every service process: config -> logging -> server -> metrics -> serve.

A service describes its parts as a `Service` subclass (what to load, what to register, what to
report, what to close); `main` and `serve` run them in the same order for all four services:

    main(RouterService, RouterConfig, ENV_PREFIX, argv)   # exit 2 on a bad config
      serve(): log "starting" -> credentials, interceptors, tracing -> prepare() -> build_server -> register() -> server.start()
               -> started() -> SERVING -> metrics endpoint -> port file -> log "serving"
               -> wait for SIGTERM/SIGINT -> stopping() -> shutdown(server) -> close() -> flush spans -> "stopped"

Shutdown is the existing common/mesh/server helpers, called here and nowhere else.
"""
from __future__ import annotations

import os
import sys
from typing import Any, ClassVar, Sequence

import grpc

from common.mesh import channels, tls, tracing
from common.mesh.auth import check_secrets
from common.mesh.config import ConfigError, describe, load_config
from common.mesh.log import adopt_library_loggers, setup_logging
from common.mesh.metrics import start_metrics_server
from common.mesh.server import (build_server, mark_serving, run, shutdown, wait_for_shutdown_signal,
                               write_port_file)


class StartupFailed(Exception):
    """prepare() could not start the service (already logged): the process exits with status 1."""


class Service:
    """One service process. Subclasses set the names and override the hooks they need."""

    name: ClassVar[str]          # "segcache": logger name, metrics label, `python -m services.<name>`
    grpc_service: ClassVar[str]  # "hypic.v1.Segcache": the name health checks ask for

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.log: Any = None  # the process logger, set by serve() before prepare()

    async def prepare(self) -> None:
        """Before the server exists: load the model / open the store, warm up."""

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Server interceptors beyond observability: who may call what (common/mesh/auth.py)."""
        return []

    def server_options(self) -> list[tuple[str, Any]]:
        """gRPC server options beyond the message-size ones (common/mesh/server.py), which
        they override: e.g. segcache's fixed HTTP/2 windows."""
        return []

    def register(self, server: grpc.aio.Server, port: int) -> None:
        """Add the servicer to `server` (bound to `port`)."""
        raise NotImplementedError

    async def started(self) -> None:
        """After server.start(), before the service reports SERVING."""

    def port_info(self) -> dict[str, Any]:
        """Extra fields of the port file (beside port, metrics_port, pid)."""
        return {}

    def serving_info(self) -> dict[str, Any]:
        """Extra fields of the "serving" log line."""
        return {}

    async def stopping(self) -> None:
        """A shutdown signal arrived; the server still runs."""

    async def close(self) -> None:
        """The server has stopped: release everything."""


async def serve(service: Service) -> int:
    """Run `service` until SIGTERM/SIGINT; the process's exit status."""
    cfg = service.cfg
    log = service.log = setup_logging(service.name, cfg.log_level, json=cfg.log_json)
    log.info("starting", config=describe(cfg))
    try:  # before prepare(): a bad certificate fails in a second, not after loading a model
        credentials = tls.server_credentials(cfg)
        channels.channel_credentials(cfg)  # the client side toward peers reads the same files
        check_secrets(cfg)
        interceptors = service.interceptors()
        if tracing.setup_tracing(service.name, cfg.otlp_endpoint):  # before any channel opens
            interceptors = [tracing.TracingServerInterceptor(), *interceptors]
    except (OSError, ValueError) as e:  # a certificate, key or secret file that cannot be read
        log.error("cannot load credentials", error=str(e))
        return 1
    try:
        await service.prepare()
    except StartupFailed:
        return 1
    adopt_library_loggers()  # what prepare() imported (transformers, nixl) logs as JSON too
    server, port, health = build_server(service.name, host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes,
                                        interceptors=interceptors, credentials=credentials,
                                        options=service.server_options())
    service.register(server, port)
    await server.start()
    await service.started()
    await mark_serving(health, service.grpc_service)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
    write_port_file(cfg.port_file, port=port, metrics_port=metrics_port, pid=os.getpid(),
                    **service.port_info())
    log.info("serving", host=cfg.host, port=port, metrics_port=metrics_port,
             tls=tls.server_credentials_kind(cfg), **service.serving_info())
    sig = await wait_for_shutdown_signal()
    log.info("shutting down", signal=sig)
    await service.stopping()
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)
    await service.close()
    tracing.shutdown_tracing()  # the spans still batched go out before the process ends
    log.info("stopped")
    return 0


def main(service_class: type[Service], config_class: type, env_prefix: str,
         argv: Sequence[str] | None = None) -> int:
    """`python -m services.<name>`: load the config (status 2 when it is bad), then serve."""
    name = service_class.name
    try:
        cfg = load_config(config_class, list(sys.argv[1:] if argv is None else argv),
                          env_prefix=env_prefix, prog=f"python -m services.{name}")
    except ConfigError as e:
        print(f"{name}: configuration error: {e}", file=sys.stderr)
        return 2
    return run(lambda: serve(service_class(cfg))) or 0

