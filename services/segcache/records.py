"""The segment store's records: tier numbers, errors, the index entry, leases and tier counters.

Shared by the store (store.py), its LMDB file (lmdb_file.py) and the NIXL lease manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from services.segcache.policy import Policy

from common.engine.checksum import DIGEST_BYTES, checksum  # noqa: F401  (the one checksum; re-exported)
from common.engine.dtypes import ENTRY_FORMATS
from common.engine.pic.seal import ForgedEntry, header_of

TIER_MISS, TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2, 3
TIER_NAMES = {TIER_MISS: "miss", TIER_DEVICE: "device", TIER_HOST: "host", TIER_DISK: "disk"}
# The LMDB value's header (lmdb_file.py): magic, version, flags, payload length, XXH3-128 digest.
# Here because an entry's stored length counts it.
HEADER_BYTES = 32


# ---- errors -------------------------------------------------------------------------------
class SegcacheError(Exception):
    """Base of the store's errors; `code` names the gRPC status the servicer answers with."""

    code = "INTERNAL"


class InvalidRequest(SegcacheError):
    code = "INVALID_ARGUMENT"


class EntryTooLarge(SegcacheError):
    code = "RESOURCE_EXHAUSTED"


class CacheFull(SegcacheError):
    """No room even after evicting every evictable entry (the rest are pinned or leased)."""

    code = "RESOURCE_EXHAUSTED"


class ChecksumMismatch(SegcacheError):
    code = "DATA_LOSS"


class CorruptEntry(Exception):
    """Internal: an LMDB value failed verification."""


# ---- records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EntryInfo:
    key: str
    tier: int
    size: int
    recompute_cost_s: float
    token_count: int
    model_fingerprint: str
    checksum: bytes
    pinned: bool


@dataclass(frozen=True)
class PutResult:
    info: EntryInfo
    created: bool


@dataclass(eq=False)
class Entry:
    key: str
    size: int
    cost: float
    tokens: int
    fingerprint: str
    digest: bytes
    pinned: bool = False
    leases: int = 0
    hits: int = 0
    host: np.ndarray | None = None
    device: Any = None  # torch.Tensor on the GPU
    on_disk: bool = False
    deleted: bool = False
    format: str = "other"  # storage format of the entry's T and S, from its header (entry_format)

    @property
    def stored_len(self) -> int:
        return HEADER_BYTES + self.size

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.leases == 0 and not self.deleted

    @property
    def freq(self) -> int:
        return self.hits + 1


@dataclass(eq=False)
class HostLease:
    """A host buffer handed to a reader (NIXL). While it is held the entry cannot be evicted;
    if the entry is deleted meanwhile, the buffer stays alive (and counted) until release."""

    entry: Entry
    buf: np.ndarray
    staged: bool  # True: a private copy (entry not host-resident), not part of the host tier


@dataclass
class TierState:
    tier: int
    budget: int
    enabled: bool
    policy: Policy
    bytes: int = 0
    peak: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0

    @property
    def name(self) -> str:
        return TIER_NAMES[self.tier]

    # entry format -> [bytes, entries], kept with bytes and entries (format_totals: the reference)
    formats: dict[str, list[int]] = field(default_factory=dict)

    def add(self, n: int, fmt: str = "other") -> None:
        """An entry of `n` bytes in format `fmt` (Entry.format) joins the tier."""
        self.bytes += n
        self.entries += 1
        if self.bytes > self.peak:
            self.peak = self.bytes
        acc = self.formats.setdefault(fmt, [0, 0])
        acc[0] += n
        acc[1] += 1

    def sub(self, n: int, fmt: str = "other", count: bool = True) -> None:
        """`n` bytes of format `fmt` leave the tier, and (count) their entry."""
        self.bytes -= n
        acc = self.formats.setdefault(fmt, [0, 0])
        acc[0] -= n
        if count:
            self.entries -= 1
            acc[1] -= 1

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "name": self.name, "enabled": self.enabled,
                "budget_bytes": self.budget if self.enabled else 0, "bytes": self.bytes,
                "peak_bytes": self.peak, "entries": self.entries, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions,
                "promotions": self.promotions}


# ---- entry formats --------------------------------------------------------------------------
# The metrics' format label: a format this segcache knows, else "other" (a bounded label set,
# whatever a writer sends).
FORMAT_LABELS = (*ENTRY_FORMATS, "other")


def entry_format(data: Any) -> str:
    """The storage format an entry's bytes name in their header (common/engine/pic/entry.py):
    its "format" field; "fp32" for the versions written before formats existed (1, 2), which
    have none; "other" for a format this segcache does not know, or bytes that are no entry.
    Read from the header, not from a Put field: the header is what a combine parses, and the seal
    that segcache checks on Put (when it has the mesh's secret) covers it."""
    try:
        header = header_of(data)
    except ForgedEntry:
        return "other"
    if header.get("version") in (1, 2):  # entry.py reads these as fp32 whatever else they say
        return "fp32"
    fmt = header.get("format")
    return fmt if fmt in ENTRY_FORMATS else "other"


def format_totals(entries: Iterable[Entry]) -> dict[tuple[str, str], list[int]]:
    """(tier name, format) -> [bytes, entries] over indexed entries, counted as TierState counts
    them (memory tiers: the entry's size; disk: its stored length), by a scan of the index: the
    reference for TierState.formats, which the store keeps as entries come and go."""
    out: dict[tuple[str, str], list[int]] = {}
    for e in entries:
        fmt = e.format if e.format in FORMAT_LABELS else "other"
        for tier, held, n in (("device", e.device is not None, e.size), ("host", e.host is not None, e.size),
                              ("disk", e.on_disk, e.stored_len)):
            if held:
                acc = out.setdefault((tier, fmt), [0, 0])
                acc[0] += n
                acc[1] += 1
    return out


def as_array(data: Any) -> np.ndarray:
    """A 1-D uint8 array the store may keep: bytes/bytearray/ndarray are adopted without a
    copy (the caller must not mutate them afterwards); anything else is copied."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if isinstance(data, (bytes, bytearray)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.frombuffer(bytes(memoryview(data).cast("B")), dtype=np.uint8)


def check_key(key: Any, max_key_bytes: int) -> str:
    """`key` when it is a non-empty string of at most max_key_bytes UTF-8 bytes without NUL;
    InvalidRequest otherwise."""
    if not isinstance(key, str) or not key:
        raise InvalidRequest("key must be a non-empty string")
    n = len(key.encode("utf-8"))
    if n > max_key_bytes:
        raise InvalidRequest(f"key is {n} bytes; the limit is {max_key_bytes}")
    if "\x00" in key:
        raise InvalidRequest("key must not contain NUL")
    return key


def check_entry_size(size: int, cfg: Any) -> None:
    """InvalidRequest for an empty entry, EntryTooLarge above cfg.entry_limit (a SegcacheConfig)."""
    if size <= 0:
        raise InvalidRequest("entry size must be > 0")
    limit = cfg.entry_limit
    if size > limit:
        raise EntryTooLarge(f"entry of {size} bytes exceeds the {limit}-byte limit "
                            f"(host {cfg.host_bytes}, disk {cfg.disk_bytes}, "
                            f"max_entry {cfg.max_entry_bytes or 'auto'})")
