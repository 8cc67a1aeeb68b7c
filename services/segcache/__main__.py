"""python -m services.segcache [--port 0 --port-file PATH --data-dir DIR ...]

Runs the segcache gRPC service until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "nixl": ...} there (atomically), which is how
tests and launchers learn an ephemeral port. `--help` lists every flag and its env variable.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import REGISTRY

from common.rpc.config import ConfigError, describe, load_config
from common.rpc.log import setup_logging
from common.rpc.metrics import start_metrics_server
from common.rpc.server import (build_server, mark_serving, run, shutdown,
                               wait_for_shutdown_signal, write_port_file)
from protos.hypic.v1 import segcache_pb2_grpc
from services.segcache.config import ENV_PREFIX, SegcacheConfig
from services.segcache.metrics import StoreCollector
from services.segcache.nixl_agent import LeaseManager
from services.segcache.servicer import SERVICE_NAME, SegcacheServicer
from services.segcache.store import SegmentStore


async def serve(cfg: SegcacheConfig) -> None:
    log = setup_logging("segcache", cfg.log_level, json=cfg.log_json)
    log.info("starting", config=describe(cfg))
    executor = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="segcache-io")
    store = SegmentStore(cfg)
    leases = LeaseManager(store, enabled=cfg.nixl, backend=cfg.nixl_backend, ttl_s=cfg.lease_ttl_s)
    REGISTRY.register(StoreCollector(store, lambda: leases.active))
    server, port, health = build_server("segcache", host=cfg.host, port=cfg.port,
                                        max_message_bytes=cfg.max_message_bytes)
    segcache_pb2_grpc.add_SegcacheServicer_to_server(
        SegcacheServicer(cfg, store, leases, executor), server)
    await server.start()
    await mark_serving(health, SERVICE_NAME)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.metrics_host)

    async def reap() -> None:
        period = max(0.05, min(1.0, cfg.lease_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            await asyncio.get_running_loop().run_in_executor(executor, leases.expire)

    reaper = asyncio.create_task(reap())
    write_port_file(cfg.port_file, port=port, metrics_port=metrics_port, pid=os.getpid(),
                    nixl=leases.available)
    log.info("serving", host=cfg.host, port=port, metrics_port=metrics_port,
             nixl=leases.available, nixl_reason=leases.reason or None)
    sig = await wait_for_shutdown_signal()
    log.info("shutting down", signal=sig)
    reaper.cancel()
    await shutdown(server, health, grace_s=cfg.grace_s, drain_s=cfg.drain_s)
    leases.close()
    executor.shutdown(wait=True)
    store.close()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(SegcacheConfig, sys.argv[1:] if argv is None else argv,
                          env_prefix=ENV_PREFIX, prog="python -m services.segcache")
    except ConfigError as e:
        print(f"segcache: configuration error: {e}", file=sys.stderr)
        return 2
    run(lambda: serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
