"""python -m services.router --model DIR [--port 0 --port-file PATH --segcache-address ADDR
                                     --scatter-addresses A,B --combine-addresses C ...]

Runs the router gRPC service until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "fingerprint": ...} there (atomically), which is
how tests and launchers learn an ephemeral port. `--help` lists every flag and its env variable.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from common.rpc.config import ConfigError, describe, load_config
from common.rpc.log import setup_logging
from common.rpc.metrics import start_metrics_server
from common.rpc.server import (build_server, mark_serving, run, shutdown,
                               wait_for_shutdown_signal, write_port_file)
from protos.hypic.v1 import router_pb2_grpc
from services.router.config import ENV_PREFIX, RouterConfig
from services.router.model import ModelError, ModelInfo
from services.router.servicer import SERVICE_NAME, RouterServicer


async def serve(cfg: RouterConfig) -> int:
    log = setup_logging("router", cfg.log_level, json=cfg.log_json)
    log.info("starting", config=describe(cfg))
    executor = ThreadPoolExecutor(max_workers=cfg.tokenizer_threads, thread_name_prefix="router-tok")
    loop = asyncio.get_running_loop()
    try:
        model = await loop.run_in_executor(executor, ModelInfo.load, cfg.model)
    except (ModelError, OSError, ValueError) as e:
        log.error("cannot load the model", model=str(cfg.model), error=str(e))
        executor.shutdown(wait=False)
        return 1
    log.info("model", model_type=model.model_type, vocab_size=model.vocab_size,
             fingerprint=model.fingerprint, tokenizer=model.tokenizer is not None)
    server, port, health = build_server("router", host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes)
    servicer = RouterServicer(cfg, model, executor)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    await server.start()
    servicer.start_background()
    await mark_serving(health, SERVICE_NAME)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
    write_port_file(cfg.port_file, port=port, metrics_port=metrics_port, pid=os.getpid(),
                    fingerprint=model.fingerprint)
    log.info("serving", host=cfg.host, port=port, metrics_port=metrics_port,
             segcache=cfg.segcache_address or None, scatter=cfg.scatters,
             combine=cfg.combines)
    sig = await wait_for_shutdown_signal()
    log.info("shutting down", signal=sig)
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)
    await servicer.close()
    executor.shutdown(wait=True)
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(RouterConfig, sys.argv[1:] if argv is None else argv,
                          env_prefix=ENV_PREFIX, prog="python -m services.router")
    except ConfigError as e:
        print(f"router: configuration error: {e}", file=sys.stderr)
        return 2
    return run(lambda: serve(cfg)) or 0


if __name__ == "__main__":
    sys.exit(main())
