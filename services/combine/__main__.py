"""python -m services.combine --model DIR [--port 0 --port-file PATH --segcache-address HOST:PORT ...]

Runs one combine worker until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "model_fingerprint": ...} there (atomically),
which is how tests and launchers learn an ephemeral port. `--help` lists every flag and its env
variable (HYPIC_COMBINE_*).
"""

from __future__ import annotations

import asyncio
import sys

from common.engine.hybrid_engine import HybridEngine
from common.mesh import service
from common.mesh.log import adopt_library_loggers
from common.mesh.nixl_listen import restrict_nixl_to_host
from common.mesh.discovery import MemberSet, parse_target
from common.mesh.segcache_ring import parse_addresses
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from services.combine.config import ENV_PREFIX, CombineConfig
from services.combine.servicer import SERVICE_NAME, CombineServicer


def warmup(engine) -> None:
    """One tiny hypic prompt: first-call costs (allocator, kernels) are not a request's."""
    ids = [i % engine.vocab_size for i in range(24)]
    for order in ("segment", "layer"):  # plans with misses, and warm plans (all hits)
        engine.prefill_segments([ids[:12], ids[12:]], ids[:4], mode="hypic", seam=4, order=order)


class CombineService(service.Service):
    name = "combine"
    grpc_service = SERVICE_NAME
    cfg: CombineConfig
    engine: HybridEngine  # loaded by prepare()

    async def prepare(self) -> None:
        self.nixl_devices = restrict_nixl_to_host(self.cfg.host)  # before the first NIXL agent
        cfg = self.cfg
        self.engine = await asyncio.to_thread(HybridEngine.for_worker, cfg.model, cfg.dtype, cfg.device,
                                              cfg.threads, cfg.entry_format)
        adopt_library_loggers()  # transformers, imported just now, logs as JSON too
        self.servicer = CombineServicer(self.cfg, self.engine)
        if cfg.fault:
            self.log.warning("FAULT INJECTED: this combine serves wrong answers on purpose (drills and "
                             "tests only)", fault=cfg.fault)
        if self.cfg.warmup:
            await self.servicer.run(warmup, self.engine)

    async def started(self) -> None:
        # The NIXL probe of segcache in the background, once serving: segcache may start
        # alongside this worker (hypic.launcher), and until the probe answers, hits go over gRPC.
        self.segcache_probe = (asyncio.create_task(self._probe_segcaches())
                               if self.cfg.segcache_address else None)

    async def _probe_segcaches(self) -> None:
        try:  # dns:///name:port: the members now (later ones are probed at their first plan)
            target = parse_target(self.cfg.segcache_address)
            members = (await MemberSet(target, refresh_s=0, what="segcache").refresh()
                       if target.is_dns else parse_addresses(self.cfg.segcache_address))
            for addr in members:  # one at a time: each makes its client's NIXL agent
                await self.servicer.peers.prepare(addr, timeout=60.0)
        except Exception as e:  # probed again at first use
            self.log.warning("segcache probe failed", error=f"{type(e).__name__}: {e}")

    def register(self, server, port: int) -> None:
        combine_grpc.add_CombineServicer_to_server(self.servicer, server)

    def port_info(self) -> dict:
        return {"model_fingerprint": self.engine.fingerprint}

    def serving_info(self) -> dict:
        return {"model_type": self.engine.model_type, "model_fingerprint": self.engine.fingerprint,
                "nixl_net_devices": self.nixl_devices}

    async def close(self) -> None:
        if self.segcache_probe is not None:
            self.segcache_probe.cancel()
        await self.servicer.close()


def main(argv: list[str] | None = None) -> int:
    return service.main(CombineService, CombineConfig, ENV_PREFIX, argv)


if __name__ == "__main__":
    sys.exit(main())
