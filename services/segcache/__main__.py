"""python -m services.segcache [--port 0 --port-file PATH --data-dir DIR ...]

Runs the segcache gRPC service until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "nixl": ...} there (atomically; "nixl": offered,
its agent made in the background -- NixlInfo answers once it exists), which is how
tests and launchers learn an ephemeral port. `--help` lists every flag and its env variable.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import ctypes
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import REGISTRY

from common.mesh import service
from common.mesh.nixl_listen import restrict_nixl_to_host
from protos.hypic.v1 import segcache_pb2_grpc as segcache_grpc
from services.segcache.access import writer_role_interceptor
from services.segcache.config import ENV_PREFIX, SegcacheConfig
from services.segcache.metrics import StoreCollector
from services.segcache.nixl_agent import LeaseManager
from services.segcache.remote_tier import MooncakeTier, RemoteCollector
from services.segcache.servicer import SERVICE_NAME, SegcacheServicer
from services.segcache.store import SegmentStore


M_ARENA_MAX, M_MMAP_THRESHOLD = -8, -3  # glibc mallopt parameters


def return_freed_buffers_to_the_os() -> None:
    """glibc raises its mmap threshold each time a large block is freed, then serves later large
    blocks (upload buffers, message bytes) from heap arenas that seldom shrink: segcache kept
    hundreds of MiB after uploads ended (issue 14). A fixed threshold keeps blocks of 256 KiB and
    more in their own mappings, unmapped on free; two arenas bound per-thread fragmentation."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 10)
        libc.mallopt(M_ARENA_MAX, 2)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def stream_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC server options that fix every stream's HTTP/2 receive window at `window_bytes`
    (0: none, gRPC's automatic windows). With BDP probing on, grpc-core resizes the window
    to at least 4 MiB a stream whatever lookahead_bytes says, so a client may have that much
    in flight beyond the message the servicer reads: 20 Puts, most of them refused, held
    tens of MiB outside the upload budget (issue 30). The servicer still gets each message
    it asks for whole: grpc opens the window as far as the message being read needs."""
    if window_bytes <= 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", int(window_bytes))]


class SegcacheService(service.Service):
    name = "segcache"
    grpc_service = SERVICE_NAME
    cfg: SegcacheConfig

    async def prepare(self) -> None:
        cfg = self.cfg
        self.nixl_devices = restrict_nixl_to_host(cfg.host)  # before the first NIXL agent
        return_freed_buffers_to_the_os()
        self.executor = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="segcache-io")
        self.store = SegmentStore(cfg)
        # the agent is made once serving (`started`): Get/Put need none of it
        self.leases = LeaseManager(self.store, enabled=cfg.nixl, backend=cfg.nixl_backend,
                                   ttl_s=cfg.lease_ttl_s, agent_in_background=True)
        REGISTRY.register(StoreCollector(self.store, lambda: self.leases.active))
        self.remote = (MooncakeTier(cfg.remote_url, queue_entries=cfg.remote_queue_entries,
                                    segment_bytes=cfg.remote_segment_bytes,
                                    buffer_bytes=cfg.remote_buffer_bytes,
                                    local_host=cfg.remote_local_host, bind_host=cfg.host)
                       if cfg.remote_url else None)
        if self.remote is not None:
            REGISTRY.register(RemoteCollector(self.remote))

    def interceptors(self) -> list:
        guard = writer_role_interceptor(self.cfg)
        if guard.open:
            self.log.warning("segcache writes are open to every caller: set --tls-cert/--tls-key/"
                             "--tls-ca (mutual TLS) or --write-token (docs/security.md)")
        return [guard]

    def server_options(self) -> list:
        return stream_window_options(self.cfg.stream_window_bytes)

    def register(self, server, port: int) -> None:
        servicer = SegcacheServicer(self.cfg, self.store, self.leases, self.executor)
        servicer.remote = self.remote
        segcache_grpc.add_SegcacheServicer_to_server(servicer, server)
        # What exists now (modules, the index) lives as long as the process: out of the cycle
        # collector's reach, so that the collections failed uploads ask for (UploadBudget) scan
        # only what calls create — microseconds, not the ~1.5 s a full pass over torch's objects
        # takes on the event loop.
        gc.collect()
        gc.freeze()

    async def started(self) -> None:
        self.reaper = asyncio.create_task(self._reap())
        self.leases.start_agent()

    async def _reap(self) -> None:
        """Expire lapsed NIXL leases, a few times per lease TTL."""
        period = max(0.05, min(1.0, self.cfg.lease_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            await asyncio.get_running_loop().run_in_executor(self.executor, self.leases.expire)

    def port_info(self) -> dict:
        # whether NIXL is on offer: the agent is still being made now (NixlInfo says when it is)
        return {"nixl": self.cfg.nixl}

    def serving_info(self) -> dict:
        return {"nixl": self.cfg.nixl, "nixl_net_devices": self.nixl_devices}

    async def stopping(self) -> None:
        self.reaper.cancel()

    async def close(self) -> None:
        global _EXIT_AT_ONCE
        self.leases.close()
        self.executor.shutdown(wait=True)
        self.store.close()  # LMDB first: the tier that must close cleanly
        if self.remote is not None and not self.remote.close():
            _EXIT_AT_ONCE = True


# Set when the shared tier's master was gone at shutdown: Mooncake's client then blocks a normal
# interpreter exit for ~10 s (its reconnect loop), past the launcher's grace period, so the
# process ends with os._exit once everything of ours is closed.
_EXIT_AT_ONCE = False


def main(argv: list[str] | None = None) -> int:
    return service.main(SegcacheService, SegcacheConfig, ENV_PREFIX, argv)


if __name__ == "__main__":
    code = main()
    if _EXIT_AT_ONCE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
