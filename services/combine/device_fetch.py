"""The same-GPU read of a segcache hit (issue 25): a combine on CUDA says where it is, and segcache,
when the entry is in its tier 0 on the same box and GPU, answers with a CUDA IPC handle of the
entry's device buffer instead of its bytes.

    place = reader_place(engine.device, sealed=bool(secret))   # None off CUDA: the host way only
    hit = await fetch_at_place(client, key, place, engine, check, ...)
    hit is None        a miss
    hit.entry          the "ipc" path worked: the entry, parsed from device bytes, on engine.device
    hit.data           segcache chose the host path: the sealed bytes (parse them as always)
    neither            the "ipc" path failed (logged, counted): read the host way

On an "ipc" answer the bytes are copied device to device into this process (transfer_path.open_ipc),
parsed there (common.engine.pic.device_entry: only headers reach the host), checked against the
plan (`check`), placed in the engine's dtypes (placement.place_entry), and the lease is released
(in the background: the copy is ours by then; an unreleased lease ends by itself at its TTL).
Any failure on the way falls back to the host path: never a wrong answer, never a wait beyond the
call's timeout. The seal of such bytes is not checked here (it covers every byte: host work); a
combine with the mesh's secret asks for IPC only for entries segcache checked at Put
(ReaderPlace.requires_sealed).

Counted here: hypic_combine_segcache_ipc_total{outcome="ok"|"fallback"} (kept out of
services/combine/metrics.py so that file merges easily); failures also in
hypic_combine_fallbacks_total{stage="ipc"}.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Callable

import structlog
import torch
from prometheus_client import Counter

from common.engine.pic.device_entry import entry_from_device
from common.engine.pic.entry import SegmentEntry
from common.engine.pic.placement import place_entry
from common.mesh.segcache_client import SegcacheClient
from common.mesh.transfer_path import ipc_from_pb, open_ipc, reader_place_pb
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.combine import metrics as m

log = structlog.get_logger("combine.device_fetch")

IPC_READS = Counter("hypic_combine_segcache_ipc", "segcache hits answered with a CUDA IPC handle, by outcome",
                    ["outcome"])


@functools.lru_cache(maxsize=8)
def _place(device: str, sealed: bool) -> segcache_pb.ReaderPlace:
    return reader_place_pb(device, requires_sealed=sealed)


def reader_place(device: Any, *, sealed: bool) -> segcache_pb.ReaderPlace | None:
    """What a combine whose engine runs on `device` sends with its Gets; None off CUDA (no place:
    exactly the Get of before). sealed: the combine has the mesh's secret."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _place(str(device), sealed)


@dataclass
class PlacedHit:
    info: segcache_pb.EntryInfo
    entry: SegmentEntry | None = None
    data: bytearray | None = None


def entry_from_ipc(lease: segcache_pb.DeviceLease, key: str, device: Any, dtype: torch.dtype,
                   check: Callable[[SegmentEntry], None]) -> SegmentEntry:
    """The entry a device lease lends: mapped and copied onto `device`, parsed there, checked,
    placed in the engine's dtypes (blocking: run it off the event loop)."""
    buf = open_ipc(ipc_from_pb(lease.ipc), device)
    entry = entry_from_device(buf, key)
    check(entry)
    return place_entry(entry, device, dtype)


async def _release(client: SegcacheClient, lease_id: str, request_id: str | None, timeout: float) -> None:
    try:
        await client.release_device(lease_id, request_id=request_id, timeout=timeout)
    except Exception as e:  # the lease ends by itself at its TTL
        log.info("device lease release failed; it expires by itself", lease_id=lease_id,
                 error=f"{type(e).__name__}: {e}")


async def fetch_at_place(client: SegcacheClient, key: str, place: segcache_pb.ReaderPlace, engine: Any,
                         check: Callable[[SegmentEntry], None], *, request_id: str | None, timeout: float,
                         spawn: Callable[[Any], None]) -> PlacedHit | None:
    """One Get with the reader's place (see the module docstring). spawn: runs the lease's release
    in the background (the request's background tasks)."""
    got = await client.get_at_place(key, place, verify=False, request_id=request_id, timeout=timeout)
    if got is None:
        return None
    if got.device is None:
        return PlacedHit(got.info, data=got.data)
    try:
        entry = await asyncio.wait_for(asyncio.to_thread(
            entry_from_ipc, got.device, key, engine.device, engine.dtype, check), timeout)
    except Exception as e:  # any failure: the host path decides (and drops a bad entry)
        IPC_READS.labels("fallback").inc()
        m.FALLBACKS.labels("ipc", "timeout" if isinstance(e, asyncio.TimeoutError) else "error").inc()
        log.warning("ipc read failed, reading the host way", key=key, error=f"{type(e).__name__}: {e}")
        return PlacedHit(got.info)
    finally:
        spawn(_release(client, got.device.lease_id, request_id, timeout))
    IPC_READS.labels("ok").inc()
    return PlacedHit(got.info, entry=entry)
