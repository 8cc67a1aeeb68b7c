"""segcache's tier 0 without CUDA, for tests of the same-GPU read path (issue 25): a store whose tier 0
lives on a CPU stand-in device, an IPC export stand-in (CUDA's cannot run on CPU: only its fields
travel, no process can open them), and the real servicer over them in the test's own process."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch

from common.mesh.transfer_path import IpcHandle
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from protos.hypic.v1 import segcache_pb2_grpc as segcache_grpc
from services.segcache.config import SegcacheConfig
from services.segcache.nixl_agent import LeaseManager
from services.segcache.servicer import SegcacheServicer
from services.segcache.store import SegmentStore

KiB = 1 << 10
GPU = "GPU-stand-in"  # the identity the stand-in tier 0 reports


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def place(box: str, gpu: str = "", *, ipc: bool = True, sealed: bool = False) -> segcache_pb.ReaderPlace:
    return segcache_pb.ReaderPlace(box_id=box, gpu_uuid=gpu, device_index=0, cuda_ipc=ipc, requires_sealed=sealed)


class StandInDeviceStore(SegmentStore):
    """Tier 0 on a CPU device: the tier's code paths without CUDA."""

    def _device_tier_device(self, cfg):
        self._torch = torch
        return torch.device("cpu")


EXPORTED: dict[bytes, torch.Tensor] = {}  # handle -> the buffer it stands for (stand_in_open)


def stand_in_export(buf) -> IpcHandle:
    """What export_ipc returns, minus CUDA: plain fields whose handle only stand_in_open (in this
    process) can resolve."""
    handle = b"h" + len(EXPORTED).to_bytes(63, "little")
    EXPORTED[handle] = buf
    return IpcHandle(device=0, handle=handle, storage_size_bytes=buf.numel(), storage_offset_bytes=0,
                     ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"e", event_sync_required=False,
                     tensor_offset=0, nbytes=buf.numel())


def stand_in_open(h: IpcHandle, device) -> torch.Tensor:
    """open_ipc's result without CUDA: a copy of the exported buffer on `device`."""
    return EXPORTED[h.handle].reshape(-1).view(torch.uint8).to(device, copy=True)


def stand_in_servicer(tmp_path: Path, lease_ttl_s: float = 0.5):
    """Yields (servicer, store): the real servicer over a stand-in tier 0 of 64 KiB (a generator
    for a fixture: closes everything after)."""
    cfg = SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, device_bytes=64 * KiB, host_bytes=256 * KiB,
                         disk_bytes=1 << 20, lease_ttl_s=lease_ttl_s, nixl=False)
    store = StandInDeviceStore(cfg)
    executor = ThreadPoolExecutor(2)
    servicer = SegcacheServicer(cfg, store, LeaseManager(store, enabled=False), executor)
    servicer.device_reads.gpu = GPU
    servicer.device_reads.export = stand_in_export
    yield servicer, store
    servicer.device_leases.close()
    store.close()
    executor.shutdown()


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    """The servicer on 127.0.0.1 (an ephemeral port): (server, target)."""
    server = grpc.aio.server()
    segcache_grpc.add_SegcacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
