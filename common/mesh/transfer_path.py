"""Which path an entry held in segcache takes to a reader (issue 25 item 2): the explicit policy.

    paths = transfer_paths(holder, reader, caps)       # e.g. ["ipc", "host"]
    used, data, tried = read_first(paths, readers)      # the first that works; why the others did not

Where the bytes live (`Place`: the box, and the GPU when they are in device memory) decides:

- "ipc":  same box, same GPU, both processes CUDA: a CUDA IPC handle of segcache's device buffer,
          opened in the reader's process (a device-to-device copy, no host round trip);
- "vram": same box, same GPU, NIXL with a VRAM-capable backend on both ends: a NIXL READ from
          segcache's VRAM into the reader's VRAM;
- "host": everything else (different boxes, different GPUs, an entry in host memory or on disk,
          a reader on CPU, or the faster paths unavailable): the host path the mesh has always
          used (a NIXL DRAM read or the gRPC stream), then the reader places the entry on its
          device (common.engine.pic.placement).

Different GPUs of one box go the host way on purpose: a peer-to-peer copy needs both GPUs
visible to one process and P2P enabled between them, which the one-GPU-per-container
deployments here do not give. "host" is always last, so every list ends in a path that works
without a GPU; `read_first` falls back along the list when a faster path fails at run time
(an IPC handle that will not open, a NIXL backend without VRAM).

Both ends of the "ipc" path are here: `export_ipc` (the holder: segcache's device tier, through
services/segcache/device_reads.py) turns a CUDA tensor into an `IpcHandle` of plain fields (so it
can travel in a message without pickle), `open_ipc` (the reader) maps it and copies the bytes into
its own device memory. `local_place` says where a process and its device are.

What is verified where: the choice, the fallback and the refusals of `export_ipc` / `open_ipc`
off CUDA are plain Python, tested on CPU (tests/mesh/test_transfer_path.py,
tests/services/segcache/test_device_reads.py). The IPC copy itself needs two CUDA processes:
scripts/gpu_check.py's "segcache device tier -> reader by CUDA IPC" row, not yet run on a GPU. The
"vram" reader (NIXL with VRAM on both ends) is not written: nixl's CUDA wheel does not travel to
the GPU machines (docs/gpu.md), so it could not be checked. On the wire (segcache.proto): a Get
carries the reader's `ReaderPlace` (`reader_place_pb`), an "ipc" answer an `IpcHandle` message
(`ipc_to_pb` / `ipc_from_pb`) in a device lease the reader releases (services/segcache/device_reads.py).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

PATHS = ("ipc", "vram", "host")  # fastest first


@dataclass(frozen=True)
class Place:
    """Where a buffer lives: the box (a boot id or host name both ends agree on) and, for device
    memory, the GPU's UUID (None: host memory, or a process without a GPU)."""

    box: str
    gpu: str | None = None


@dataclass(frozen=True)
class Capabilities:
    """What both ends can do (each side reports its own; a path needs both)."""

    cuda_ipc: bool = False  # both processes have CUDA and may share IPC handles
    nixl_vram: bool = False  # both NIXL agents have a backend that registers VRAM


def transfer_paths(holder: Place, reader: Place, caps: Capabilities) -> list[str]:
    """The paths to try, fastest first, always ending with "host"."""
    out = []
    same_gpu = holder.box == reader.box and holder.gpu is not None and holder.gpu == reader.gpu
    if same_gpu and caps.cuda_ipc:
        out.append("ipc")
    if same_gpu and caps.nixl_vram:
        out.append("vram")
    return out + ["host"]


class NoPath(RuntimeError):
    """Every path failed (the host path included)."""


def read_first(paths: Sequence[str], readers: Mapping[str, Callable[[], Any]]) -> tuple[str, Any, list[str]]:
    """Run the reader of each path in order until one returns: (the path used, what it returned,
    "path: why not" for every path tried before it). A path without a reader is skipped, saying
    so; NoPath when none works."""
    tried = []
    for path in paths:
        if path not in PATHS:
            raise ValueError(f"unknown transfer path {path!r} (one of {PATHS})")
        fn = readers.get(path)
        if fn is None:
            tried.append(f"{path}: no reader")
            continue
        try:
            return path, fn(), tried
        except Exception as e:  # any failure of a faster path: the next one, down to host
            tried.append(f"{path}: {type(e).__name__}: {e}")
    raise NoPath("; ".join(tried) or "no path")


# ---- where a process is ---------------------------------------------------------------------
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def box_id() -> str:
    """This machine, as every process on it (containers included: one kernel) names it: the
    kernel's boot id; the host name where there is none."""
    try:
        return BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: Any) -> str | None:
    """The UUID of a CUDA device (stable across processes, whatever CUDA_VISIBLE_DEVICES renumbers);
    None for any other device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_place(device: Any) -> Place:
    """Where a buffer on `device` in this process lives."""
    return Place(box_id(), gpu_uuid(device))


# ---- the "ipc" path: CUDA IPC between two processes on one GPU -------------------------------
@dataclass(frozen=True)
class IpcHandle:
    """torch's CUDA IPC export of one contiguous uint8 buffer, as plain fields (the arguments of
    torch.multiprocessing.reductions.rebuild_cuda_tensor that are not types)."""

    device: int  # the holder's index of its GPU (the reader maps on its own index of that GPU)
    handle: bytes  # cudaIpcMemHandle of the allocation that holds the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset in that allocation
    ref_counter_handle: bytes  # torch's shared counter: the holder frees the block once readers let go
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int  # the buffer's offset in the storage (uint8: bytes)
    nbytes: int


def export_ipc(buf: Any) -> IpcHandle:
    """The IPC handle of a contiguous CUDA tensor (viewed as bytes). The holder keeps `buf` alive
    until the reader is done (segcache: a device lease). ValueError for anything else."""
    import inspect

    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if not isinstance(buf, torch.Tensor) or buf.device.type != "cuda":
        raise ValueError(f"CUDA IPC needs a CUDA tensor, got {getattr(buf, 'device', type(buf).__name__)}")
    if not buf.is_contiguous():
        raise ValueError("CUDA IPC export of a non-contiguous tensor")
    flat = buf.reshape(-1).view(torch.uint8)
    fn, args = reduce_tensor(flat)
    if fn is not rebuild_cuda_tensor:
        raise ValueError(f"torch exported a CUDA tensor with {fn.__name__}, not rebuild_cuda_tensor")
    a = dict(zip(inspect.signature(rebuild_cuda_tensor).parameters, args))
    return IpcHandle(device=int(a["storage_device"]), handle=bytes(a["storage_handle"]),
                     storage_size_bytes=int(a["storage_size_bytes"]), storage_offset_bytes=int(a["storage_offset_bytes"]),
                     ref_counter_handle=bytes(a["ref_counter_handle"]), ref_counter_offset=int(a["ref_counter_offset"]),
                     event_handle=bytes(a["event_handle"]), event_sync_required=bool(a["event_sync_required"]),
                     tensor_offset=int(a["tensor_offset"]), nbytes=flat.numel())


def open_ipc(h: IpcHandle, device: Any) -> Any:
    """The reader's side: map the holder's buffer (in another process: CUDA refuses to open a
    handle in the process that exported it) and copy it into a new uint8 tensor on `device`, which
    must be the holder's GPU. The mapping is dropped before this returns."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"CUDA IPC needs a CUDA reader, got {device}")
    torch.cuda._lazy_init()
    # the reader's own index of the GPU: CUDA_VISIBLE_DEVICES may number it apart from the holder's
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        mapped = rebuild_cuda_tensor(torch.Tensor, torch.Size([h.nbytes]), (1,), h.tensor_offset,
                                     torch.storage.TypedStorage, torch.uint8, index, h.handle,
                                     h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
                                     h.ref_counter_offset, h.event_handle, h.event_sync_required)
        out = torch.empty(h.nbytes, dtype=torch.uint8, device=device)
        out.copy_(mapped)
        torch.cuda.current_stream().synchronize()  # the copy is done before the mapping goes
    del mapped
    return out


# ---- on the wire: segcache.proto's ReaderPlace and IpcHandle ---------------------------------
IPC_FIELDS = tuple(IpcHandle.__dataclass_fields__)


def reader_place_pb(device: Any, *, requires_sealed: bool) -> Any:
    """The ReaderPlace a process whose tensors live on `device` sends with a Get (segcache.proto):
    its box, its GPU and whether it can open CUDA IPC handles (a CUDA device: yes)."""
    import torch

    from protos.hypic.v1 import segcache_pb2 as segcache_pb

    device = torch.device(device)
    place = local_place(device)
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    return segcache_pb.ReaderPlace(box_id=place.box, gpu_uuid=place.gpu or "", device_index=index,
                                   cuda_ipc=cuda, requires_sealed=requires_sealed)


def place_of(reader: Any) -> Place:
    """The Place of a ReaderPlace message."""
    return Place(reader.box_id, reader.gpu_uuid or None)


def ipc_to_pb(h: IpcHandle) -> Any:
    from protos.hypic.v1 import segcache_pb2 as segcache_pb

    return segcache_pb.IpcHandle(**{f: getattr(h, f) for f in IPC_FIELDS})


def ipc_from_pb(msg: Any) -> IpcHandle:
    return IpcHandle(**{f: getattr(msg, f) for f in IPC_FIELDS})
