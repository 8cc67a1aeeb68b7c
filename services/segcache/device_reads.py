"""Serving a hit from segcache's device tier (tier 0, GPU memory) without a host round trip.

    reads = DeviceReads(store)                                     # the store's GPU, this box
    served = reads.serve(key, reader=Place(box, gpu), caps=Capabilities(cuda_ipc=True))
    served.path        # "ipc": served.ipc is an IpcHandle of the entry's device buffer
                       # "host": served.host is a HostLease (the NIXL DRAM / gRPC path)
    reads.release(served)                                          # when the reader is done

The path is common.mesh.transfer_path's choice: where the entry lives (the store's GPU when it
is in tier 0, else host memory) against where the reader is. Same box, same GPU and CUDA IPC on
both ends: the entry's own device tensor is exported as a CUDA IPC handle (no `.cpu()`, no
copy in segcache); the reader maps it and copies it device to device (transfer_path.open_ipc).
Anything else, or an export that fails at run time (the entry was demoted meanwhile, the tensor
is not CUDA), falls back to the host path: acquire_host, as the NIXL leases have always used.

A device lease pins the entry in tier 0 as a host lease pins it in tier 1 (no eviction, no
demotion while held: the reader's mapping must stay valid); a Delete meanwhile removes the key at
once, and its tensor lives on in the lease until release.

"vram" (NIXL with VRAM on both ends) has no reader here: nixl's CUDA wheel does not travel to
the GPU machines (docs/gpu.md), so it could not be checked; the policy skips it, saying so.

On the wire (segcache.proto): a Get that carries a ReaderPlace goes through `serve_get`; an
"ipc" answer is a DeviceLease (its id, the IpcHandle, its TTL) held in `DeviceLeaseTable` until
ReleaseDeviceLease or its TTL, like the NIXL leases (nixl_agent.LeaseManager). Reads are counted
here by the path they took: hypic_segcache_reads_total{path="ipc"|"host"} (every Get; kept out of
metrics.py, which reads the store's own bookkeeping at scrape time).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog
from prometheus_client import Counter

from common.mesh.transfer_path import Capabilities, IpcHandle, Place, box_id, export_ipc, gpu_uuid, place_of, \
    read_first, transfer_paths
from services.segcache.records import TIER_DEVICE, Entry, EntryInfo, HostLease

log = structlog.get_logger("segcache.device_reads")

# path: "ipc" (a CUDA IPC handle of tier 0's buffer) or "host" (the bytes: the gRPC stream)
READS = Counter("hypic_segcache_reads", "Get answers by the path the entry took to its reader", ["path"])


@dataclass
class DeviceLease:
    """An entry's tier-0 tensor handed to a reader on the same GPU; the entry stays in tier 0
    until release_device."""

    entry: Entry
    tensor: Any  # torch.Tensor on the store's device


class DeviceLeases:
    """acquire_device / release_device of SegmentStore (a mixin, as HostLeases: it works on the
    store's index under the store's `_lock`)."""

    leases_active: int

    def acquire_device(self, key: str) -> DeviceLease | None:
        """key's tier-0 tensor, pinned there until release_device(); counts as a device hit.
        None when key is not in tier 0 (a miss, or in a slower tier: the caller goes the host way,
        which counts that read)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.device is None:
                return None
            self._hit(e, TIER_DEVICE)
            e.leases += 1
            if e.leases == 1:
                self._untrack(e)
            self.leases_active += 1
            return DeviceLease(e, e.device)

    def release_device(self, lease: DeviceLease) -> None:
        with self._lock:
            e = lease.entry
            e.leases -= 1
            self.leases_active -= 1
            if e.leases == 0 and not e.deleted and self._entries.get(e.key) is e:
                self._track(e)


@dataclass
class ServedRead:
    """One read as served: the path taken and what the reader needs for it."""

    path: str  # "ipc" | "host"
    info: EntryInfo
    ipc: IpcHandle | None = None
    host: HostLease | None = None
    tried: list[str] = field(default_factory=list)  # "path: why not" for each faster path
    device: DeviceLease | None = None  # held for the ipc path until release


class DeviceReads:
    """The holder's side of transfer_path for one SegmentStore."""

    def __init__(self, store: Any, *, box: str | None = None, gpu: str | None = None,
                 export: Callable[[Any], IpcHandle] = export_ipc):
        """gpu: the identity of the store's GPU (default: its CUDA UUID; None without tier 0).
        export: the IPC export (tests on CPU, where CUDA's cannot run, hand in a stand-in)."""
        self.store = store
        self.export = export
        self.box = box or box_id()
        dev = store._cuda if store.device.enabled else None
        self.gpu = gpu if gpu is not None else (gpu_uuid(dev) if dev is not None else None)

    def holder(self, key: str) -> Place:
        """Where key's bytes are now: the store's GPU when in tier 0, else this box's host memory."""
        on_gpu = self.store.tier_of(key) == TIER_DEVICE and self.gpu is not None
        return Place(self.box, self.gpu if on_gpu else None)

    def serve(self, key: str, reader: Place, caps: Capabilities) -> ServedRead | None:
        """Serve key to `reader` by the first path that works; None on a miss (every tier)."""
        paths = transfer_paths(self.holder(key), reader, caps)
        path, served, tried = read_first(paths, {"ipc": lambda: self._ipc(key), "host": lambda: self._host(key)})
        if served is not None:
            served.tried = tried
        return served

    def _ipc(self, key: str) -> ServedRead:
        lease = self.store.acquire_device(key)
        if lease is None:
            raise LookupError("no longer in the device tier")
        try:
            handle = self.export(lease.tensor)
        except Exception:
            self.store.release_device(lease)
            raise
        return ServedRead("ipc", self.store._info(lease.entry), ipc=handle, device=lease)

    def _host(self, key: str) -> ServedRead | None:
        lease = self.store.acquire_host(key)
        if lease is None:
            return None
        return ServedRead("host", self.store._info(lease.entry), host=lease)

    def release(self, served: ServedRead) -> None:
        if served.device is not None:
            self.store.release_device(served.device)
            served.device = None
        if served.host is not None:
            self.store.release_host(served.host)
            served.host = None

    def serve_get(self, key: str, reader: Any, seal_checked: bool) -> ServedRead | None:
        """A Get with a ReaderPlace (segcache.proto): the "ipc" path when the policy allows it,
        else None (the caller streams the bytes, as for a Get without a place). seal_checked:
        segcache refuses Puts whose seal does not open; a reader that requires it gets no
        handle otherwise (it cannot check a seal over bytes it never copies to the host)."""
        caps = Capabilities(cuda_ipc=reader.cuda_ipc and self.gpu is not None
                            and (seal_checked or not reader.requires_sealed))
        if "ipc" not in transfer_paths(self.holder(key), place_of(reader), caps):
            return None
        try:
            served = self._ipc(key)
        except Exception as e:  # demoted or deleted meanwhile, or the export failed: the bytes
            log.warning("ipc read fell back to host", key=key, error=f"{type(e).__name__}: {e}")
            return None
        return served


@dataclass
class _HeldLease:
    served: ServedRead
    expires_at: float


class DeviceLeaseTable:
    """Device leases handed to readers by id: held until release(id) or until they expire
    (expire(), which the servicer schedules one TTL after each open)."""

    def __init__(self, reads: DeviceReads, ttl_s: float):
        self.reads = reads
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._held: dict[str, _HeldLease] = {}

    def open(self, served: ServedRead) -> str:
        lease_id = uuid.uuid4().hex
        with self._lock:
            self._held[lease_id] = _HeldLease(served, time.monotonic() + self.ttl_s)
        return lease_id

    def release(self, lease_id: str) -> bool:
        with self._lock:
            held = self._held.pop(lease_id, None)
        if held is None:
            return False
        self.reads.release(held.served)
        return True

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            lapsed = [(i, h) for i, h in self._held.items() if h.expires_at <= now]
            for i, _ in lapsed:
                del self._held[i]
        for i, h in lapsed:
            log.warning("device lease expired", lease_id=i, key=h.served.info.key)
            self.reads.release(h.served)
        return len(lapsed)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for h in held:
            self.reads.release(h.served)
