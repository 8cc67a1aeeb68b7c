"""The server side of the NIXL path: one NIXL agent, and leases on host-tier entries.

Lease choice (see docs/segcache.md): a reader asks for a lease on a key; the store makes the
entry resident in host DRAM (promoting it from LMDB if needed) and *pins it for the lease*
(SegmentStore.acquire_host), so it can be neither evicted nor freed while the reader pulls
it. The entry's own buffer is registered with the agent -- no staging copy -- and the reader
gets plain (addr, length, device) descriptors. Registrations are refcounted per buffer:
registered on the first lease, deregistered when the last lease on it ends; the lease carries
the region's partial agent metadata, which the reader loads before its READ. A lease ends on
ReleaseNixlLease or, if the reader never says so, after lease_ttl_s. A Delete during a lease
removes the key at once, but its buffer stays allocated and registered until the lease ends.
Readers verify the checksum returned with the lease (or, like the combine, the entry's own
digest over every byte), so even a reader that outlives its lease can never accept wrong bytes.

Without nixl (not installed, no UCX backend, --no-nixl) the service still runs: NixlInfo
reports available=false with the reason and OpenNixlLease answers FAILED_PRECONDITION.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import structlog

from common.mesh.nixl_util import NixlAgent, NixlUnavailable
from services.segcache.store import TIER_HOST, EntryInfo, HostLease, SegmentStore

log = structlog.get_logger("segcache.nixl")


@dataclass
class Lease:
    lease_id: str
    host: HostLease
    info: EntryInfo
    mem_type: str
    descriptors: list[tuple[int, int, int]]
    region_metadata: bytes
    reader: str
    expires_at: float


@dataclass
class _Registration:
    handle: Any
    buf: Any  # keeps the buffer alive while registered
    metadata: bytes  # partial agent metadata of the region, for the reader
    refs: int = 0


class LeaseManager:
    """The NIXL leases and the agent they use. agent_in_background: the agent (nixl's import and
    its UCX worker, about a second of CPU) is made by `start_agent` on a thread instead of here,
    so that segcache serves Get/Put without waiting for it (issue 29: the mesh's start is its
    processes' CPU); until it exists `starting` is True and NixlInfo waits for it or answers
    UNAVAILABLE (the combine probes again)."""

    def __init__(self, store: SegmentStore, *, enabled: bool = True, backend: str = "UCX",
                 ttl_s: float = 30.0, agent_name: str | None = None,
                 agent_in_background: bool = False):
        self.store = store
        self.ttl_s = ttl_s
        self.backend = backend
        self._enabled = enabled
        self._agent_name = agent_name or f"segcache-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._regs: dict[int, _Registration] = {}  # id(buffer) -> registration
        self.agent_made = threading.Event()
        self._maker: threading.Thread | None = None
        self.agent: NixlAgent | None = None
        if not agent_in_background:
            self._make_agent()

    def start_agent(self) -> None:
        """Make the agent on a thread (agent_in_background); `agent_made` is set once it exists."""
        if self._maker is None and not self.agent_made.is_set():
            self._maker = threading.Thread(target=self._make_agent, name="nixl-agent", daemon=True)
            self._maker.start()

    def _make_agent(self) -> None:
        agent = NixlAgent(self._agent_name, self.backend, enabled=self._enabled)
        self.agent = agent
        self.agent_made.set()
        if agent.available:
            log.info("nixl agent ready", agent=agent.name, backend=self.backend)
        else:
            log.warning("nixl path unavailable", reason=agent.reason)

    @property
    def starting(self) -> bool:
        """The agent is still being made in the background."""
        return self.agent is None

    @property
    def available(self) -> bool:
        return self.agent is not None and self.agent.available

    @property
    def reason(self) -> str:
        if self.agent is None:
            return "nixl agent starting"
        return self.agent.reason or ""

    def info(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason, "agent_name": "", "metadata": b"",
                    "backend": self.backend}
        return {"available": True, "reason": "", "agent_name": self.agent.name,
                "metadata": self.agent.metadata(), "backend": self.agent.backend}

    def open(self, key: str, reader: str = "") -> Lease | None:
        """Lease key's host buffer. None on a miss. Raises NixlUnavailable without nixl."""
        if not self.available:
            raise NixlUnavailable(self.reason)
        host = self.store.acquire_host(key)
        if host is None:
            return None
        try:
            with self._lock:
                reg = self._regs.get(id(host.buf))
                if reg is None:
                    handle = self.agent.register(host.buf)
                    reg = _Registration(handle, host.buf, self.agent.region_metadata(handle))
                    self._regs[id(host.buf)] = reg
                reg.refs += 1
            mem_type, descs = self.agent.descriptors(host.buf)
        except Exception:
            self.store.release_host(host)
            raise
        lease = Lease(lease_id=uuid.uuid4().hex, host=host, info=self.store_info(host),
                      mem_type=mem_type, descriptors=descs, region_metadata=reg.metadata,
                      reader=reader,
                      expires_at=time.monotonic() + self.ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def store_info(self, host: HostLease) -> EntryInfo:
        e = host.entry
        return EntryInfo(e.key, self.store.tier_of(e.key) or TIER_HOST, e.size, e.cost, e.tokens,
                         e.fingerprint, e.digest, e.pinned)

    def _end(self, lease: Lease) -> None:
        buf_id = id(lease.host.buf)
        handle = None
        with self._lock:
            reg = self._regs.get(buf_id)
            if reg is not None:
                reg.refs -= 1
                if reg.refs == 0:
                    del self._regs[buf_id]
                    handle = reg.handle
        if handle is not None:
            try:
                self.agent.deregister(handle)
            except Exception as e:
                log.error("nixl deregister failed", error=str(e))
        self.store.release_host(lease.host)

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [l for l in self._leases.values() if l.expires_at <= now]
            for l in expired:
                del self._leases[l.lease_id]
        for l in expired:
            log.warning("nixl lease expired", lease_id=l.lease_id, key=l.info.key, reader=l.reader)
            self._end(l)
        return len(expired)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for l in leases:
            self._end(l)
        if self._maker is not None:  # an agent still being made is closed too, not left to exit
            self._maker.join()
        if self.agent is not None:
            self.agent.close()
