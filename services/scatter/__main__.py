"""python -m services.scatter --model DIR [--port 0 --port-file PATH --segcache-address HOST:PORT ...]

Runs one scatter worker until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "worker": ..., "model_fingerprint": ...} there
(atomically), which is how tests and launchers learn an ephemeral port. `--help` lists every
flag and its env variable (HYPIC_SCATTER_*).
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from common.rpc.config import ConfigError, describe, load_config
from common.rpc.log import setup_logging
from common.rpc.metrics import start_metrics_server
from common.rpc.segcache_client import SegcacheClient
from common.rpc.server import (build_server, format_address, mark_serving, run, shutdown,
                               wait_for_shutdown_signal, write_port_file)
from protos.hypic.v1 import scatter_pb2_grpc
from services.scatter.config import ENV_PREFIX, ScatterConfig
from services.scatter.servicer import SERVICE_NAME, ScatterServicer


def load_engine(cfg: ScatterConfig):
    import torch

    from common.engine import HybridEngine
    from common.pic.entry import DTYPES

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return HybridEngine.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device,
                                        load_tokenizer=False)


async def serve(cfg: ScatterConfig) -> None:
    log = setup_logging("scatter", cfg.log_level, json=cfg.log_json)
    log.info("starting", config=describe(cfg))
    loop = asyncio.get_running_loop()
    engine = await asyncio.to_thread(load_engine, cfg)
    # One build thread: builds share one model (and build_entry hooks its layers while it runs),
    # and torch already spreads one build over the cores.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scatter-build")
    if cfg.warmup:  # first-call costs (allocator, kernels) are not a request's
        await loop.run_in_executor(executor, engine.build_entry,
                                   [i % engine.vocab_size for i in range(16)], 8)
    server, port, health = build_server("scatter", host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes)
    worker = cfg.worker or f"scatter@{format_address(cfg.host, port)}"
    segcache = (SegcacheClient(cfg.segcache_address, max_message_bytes=cfg.max_message_bytes,
                               timeout_s=cfg.segcache_timeout_s)
                if cfg.segcache_address else None)
    scatter_pb2_grpc.add_ScatterServicer_to_server(
        ScatterServicer(cfg, engine, executor, segcache, worker), server)
    await server.start()
    await mark_serving(health, SERVICE_NAME)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
    write_port_file(cfg.port_file, port=port, metrics_port=metrics_port, pid=os.getpid(),
                    worker=worker, model_fingerprint=engine.fingerprint)
    log.info("serving", host=cfg.host, port=port, metrics_port=metrics_port, worker=worker,
             model_type=engine.model_type, model_fingerprint=engine.fingerprint)
    sig = await wait_for_shutdown_signal()
    log.info("shutting down", signal=sig)
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)
    if segcache is not None:
        await segcache.close()
    executor.shutdown(wait=True, cancel_futures=True)
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(ScatterConfig, sys.argv[1:] if argv is None else argv,
                          env_prefix=ENV_PREFIX, prog="python -m services.scatter")
    except ConfigError as e:
        print(f"scatter: configuration error: {e}", file=sys.stderr)
        return 2
    run(lambda: serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
