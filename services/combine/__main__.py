"""python -m services.combine --model DIR [--port 0 --port-file PATH --segcache-address HOST:PORT ...]

Runs one combine worker until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "model_fingerprint": ...} there (atomically),
which is how tests and launchers learn an ephemeral port. `--help` lists every flag and its env
variable (HYPIC_COMBINE_*).
"""

from __future__ import annotations

import asyncio
import os
import sys

from common.rpc.config import ConfigError, describe, load_config
from common.rpc.log import setup_logging
from common.rpc.metrics import start_metrics_server
from common.rpc.server import (build_server, mark_serving, run, shutdown,
                               wait_for_shutdown_signal, write_port_file)
from protos.hypic.v1 import combine_pb2_grpc
from services.combine.config import ENV_PREFIX, CombineConfig
from services.combine.servicer import SERVICE_NAME, CombineServicer


def load_engine(cfg: CombineConfig):
    import torch

    from common.engine import HybridEngine
    from common.pic.entry import DTYPES

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return HybridEngine.from_pretrained(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device,
                                        load_tokenizer=False)


def warmup(engine) -> None:
    """One tiny hypic prompt: first-call costs (allocator, kernels) are not a request's."""
    ids = [i % engine.vocab_size for i in range(24)]
    for order in ("segment", "layer"):  # plans with misses, and warm plans (all hits)
        engine.prefill_segments([ids[:12], ids[12:]], ids[:4], mode="hypic", seam=4, order=order)


async def serve(cfg: CombineConfig) -> None:
    log = setup_logging("combine", cfg.log_level, json=cfg.log_json)
    log.info("starting", config=describe(cfg))
    engine = await asyncio.to_thread(load_engine, cfg)
    servicer = CombineServicer(cfg, engine)
    if cfg.warmup:
        await servicer.run(warmup, engine)
    if cfg.segcache_address:  # NIXL agent and probe now, not in the first request
        await servicer.peers.prepare(cfg.segcache_address, timeout=60.0)
    server, port, health = build_server("combine", host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes)
    combine_pb2_grpc.add_CombineServicer_to_server(servicer, server)
    await server.start()
    await mark_serving(health, SERVICE_NAME)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
    write_port_file(cfg.port_file, port=port, metrics_port=metrics_port, pid=os.getpid(),
                    model_fingerprint=engine.fingerprint)
    log.info("serving", host=cfg.host, port=port, metrics_port=metrics_port,
             model_type=engine.model_type, model_fingerprint=engine.fingerprint)
    sig = await wait_for_shutdown_signal()
    log.info("shutting down", signal=sig)
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)
    await servicer.close()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(CombineConfig, sys.argv[1:] if argv is None else argv,
                          env_prefix=ENV_PREFIX, prog="python -m services.combine")
    except ConfigError as e:
        print(f"combine: configuration error: {e}", file=sys.stderr)
        return 2
    run(lambda: serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
