"""python -m services.front --model DIR --router-addresses HOST:PORT[,...] [--port 8000
                            --port-file PATH --api-key KEY ...]

Serves the OpenAI-compatible API on uvicorn until SIGTERM/SIGINT. With --port-file, once
serving it writes {"port": ..., "pid": ...} there (atomically). `--help` lists every flag and
its HYPIC_FRONTEND_* variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import sys

from common.mesh import tracing
from common.mesh.config import ConfigError, describe, load_config
from common.mesh.log import OncePerMessage, adopt_library_loggers, level_number, setup_logging
from common.mesh.server import run, wait_for_shutdown_signal, write_port_file
from services.front.config import ENV_PREFIX, FrontConfig


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def https_options(cfg: FrontConfig) -> dict:
    """uvicorn's TLS settings: none without --https; with it the front's certificate, and the
    clients' certificates checked against --tls-ca (required under mutual TLS)."""
    if not cfg.https:
        return {}
    opts = {"ssl_certfile": str(cfg.tls_cert), "ssl_keyfile": str(cfg.tls_key)}
    if cfg.tls_ca is not None:
        opts["ssl_ca_certs"] = str(cfg.tls_ca)
        opts["ssl_cert_reqs"] = ssl.CERT_REQUIRED if cfg.mutual_tls else ssl.CERT_OPTIONAL
    return opts
# uvicorn's warnings about a client's malformed HTTP (uvicorn/protocols/http/*_impl.py)
CLIENT_ERROR_WARNINGS = ("Invalid HTTP request received.", "Unsupported upgrade request.",
                         "Invalid HTTP/2 frame received: %s")


async def serve(cfg: FrontConfig) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGTERM / SIGINT are ours (as in every Hypic service): uvicorn would re-raise the
            # signal after its shutdown and end the process before the last log line.
            yield

    from services.front.app import create_app
    from services.front.segments import ChatTemplate

    log = setup_logging("front", cfg.log_level, json=cfg.log_json)
    log.info("starting", config={**describe(cfg), "api_key": "***" if cfg.api_key else ""})
    try:
        template = await asyncio.get_running_loop().run_in_executor(None, ChatTemplate.load,
                                                                    cfg.model)
    except (OSError, ValueError) as e:  # a model without tokenizer files: token ids only
        log.warning("no tokenizer; serving without chat template", model=str(cfg.model),
                    error=str(e))
        template = ChatTemplate(None)
    adopt_library_loggers()  # transformers (the tokenizer) brings its own console handler
    tracing.setup_tracing("front", cfg.otlp_endpoint)  # off unless an OTLP endpoint is set
    # uvicorn logs through our root handler (log_config=None): its lifecycle lines (uvicorn.error)
    # at the libraries' level, its access log (one line per request) at ours.
    logging.getLogger("uvicorn.access").setLevel(level_number(cfg.log_level))
    try:  # as every service: an unreadable certificate, key or CA stops the start, said once
        for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.router_tls_ca):
            if path is not None:
                path.read_bytes()
    except OSError as e:
        log.error("cannot load credentials", error=str(e))
        return 1
    # Malformed HTTP is answered 400 by uvicorn with one warning per connection: at most one a
    # few seconds, whoever sends it (a hostile client must not fill the log).
    logging.getLogger("uvicorn.error").addFilter(OncePerMessage(CLIENT_ERROR_WARNINGS))
    try:
        sock = bind(cfg.host, cfg.port)
    except OSError as e:
        log.error("cannot bind", host=cfg.host, port=cfg.port, error=str(e))
        return 1
    port = sock.getsockname()[1]
    app = create_app(cfg, template)
    server = Server(uvicorn.Config(
        app, log_config=None, access_log=cfg.access_log, lifespan="on",
        timeout_graceful_shutdown=int(max(1, cfg.grace_s)), **https_options(cfg)))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        return 1
    write_port_file(cfg.port_file, port=port, pid=os.getpid(), model=cfg.model_name)
    scheme = "https" if cfg.https else "http"
    log.info("serving", host=cfg.host, port=port, model=cfg.model_name, routers=cfg.routers,
             chat_template=template.has_template, auth=bool(cfg.api_key),
             https=("mutual" if cfg.mutual_tls else "tls") if cfg.https else "off",
             routers_tls=cfg.routers_ca is not None, metrics=f"{scheme}://{cfg.host}:{port}/metrics")
    stop = asyncio.create_task(wait_for_shutdown_signal())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if stop.done():
        log.info("shutting down", signal=stop.result())
        server.should_exit = True  # stop accepting, let running requests finish (grace_s)
    else:
        stop.cancel()
    await task
    tracing.shutdown_tracing()  # the spans still batched go out before the process ends
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(FrontConfig, sys.argv[1:] if argv is None else argv,
                          env_prefix=ENV_PREFIX, prog="python -m services.front")
    except ConfigError as e:
        print(f"front: configuration error: {e}", file=sys.stderr)
        return 2
    return run(lambda: serve(cfg)) or 0


if __name__ == "__main__":
    sys.exit(main())
