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

What is verified where: the choice and the fallback are plain Python, tested on CPU
(tests/mesh/test_transfer_path.py). The "ipc" and "vram" readers themselves need two CUDA
processes (scripts/gpu_check.py's NIXL row); they are not wired into segcache and combine yet.
"""
from __future__ import annotations

from dataclasses import dataclass
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
