"""python -m services.scatter --model DIR [--port 0 --port-file PATH --segcache-address HOST:PORT ...]

Runs one scatter worker until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "worker": ..., "model_fingerprint": ...} there
(atomically), which is how tests and launchers learn an ephemeral port. `--help` lists every
flag and its env variable (HYPIC_SCATTER_*).
"""

from __future__ import annotations

import asyncio
import sys
import socket
from concurrent.futures import ThreadPoolExecutor

from common.engine.hybrid_engine import HybridEngine
from common.mesh import service
from common.mesh.log import adopt_library_loggers
from common.mesh.auth import read_secret
from common.mesh.channels import channel_options, open_channel
from common.mesh.segcache_ring import RECONNECT_MAX_MS, SegcacheRing
from common.mesh.server import format_address
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from services.scatter.config import ENV_PREFIX, ScatterConfig
from services.scatter.servicer import SERVICE_NAME, ScatterServicer


class ScatterService(service.Service):
    name = "scatter"
    grpc_service = SERVICE_NAME
    cfg: ScatterConfig
    engine: HybridEngine  # loaded by prepare()

    async def prepare(self) -> None:
        cfg = self.cfg
        self.engine = await asyncio.to_thread(HybridEngine.for_worker, cfg.model, cfg.dtype, cfg.device,
                                              cfg.threads, cfg.entry_format)
        adopt_library_loggers()  # transformers, imported just now, logs as JSON too
        # One build thread: builds share one model (and build_entry hooks its layers while it
        # runs), and torch already spreads one build over the cores.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scatter-build")
        if self.cfg.warmup:  # first-call costs (allocator, kernels) are not a request's
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.engine.build_entry, [i % self.engine.vocab_size for i in range(16)], 8)

    def register(self, server, port: int) -> None:
        cfg = self.cfg
        # Bound to every interface (a container, a pod): its host name tells replicas apart.
        host = socket.gethostname() if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        self.worker = cfg.worker or f"scatter@{format_address(host, port)}"
        # One address or many: each entry goes to its key's instance (rendezvous hashing).
        options = channel_options(cfg.max_message_bytes, max_backoff_ms=RECONNECT_MAX_MS)
        self.segcache = (SegcacheRing(cfg.segcache_address, max_message_bytes=cfg.max_message_bytes,
                                      timeout_s=cfg.segcache_timeout_s,
                                      open_channel=lambda a: open_channel(a, options, cfg),
                                      write_token=read_secret(cfg.write_token))
                         if cfg.segcache_address else None)
        scatter_grpc.add_ScatterServicer_to_server(
            ScatterServicer(cfg, self.engine, self.executor, self.segcache, self.worker), server)

    def port_info(self) -> dict:
        return {"worker": self.worker, "model_fingerprint": self.engine.fingerprint}

    def serving_info(self) -> dict:
        return {"worker": self.worker, "model_type": self.engine.model_type,
                "model_fingerprint": self.engine.fingerprint}

    async def close(self) -> None:
        if self.segcache is not None:
            await self.segcache.close()
        self.executor.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    return service.main(ScatterService, ScatterConfig, ENV_PREFIX, argv)


if __name__ == "__main__":
    sys.exit(main())
