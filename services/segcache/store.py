"""The tiered segment store: the index, its tiers and eviction (no gRPC here).

Tiers (numbers as in the proto's Tier enum):
  DEVICE (tier 0)  GPU memory, torch uint8 tensors; only when CUDA is available and
                   device_bytes > 0.
  HOST   (tier 1)  host DRAM, numpy uint8 arrays (also what NIXL readers pull from).
  DISK   (tier 2)  LMDB: every acknowledged entry (write-through, the default).

The memory tiers are exclusive of each other and both backed by LMDB: an entry is in at most
one of DEVICE/HOST and (once committed) always on DISK. New entries go to the fastest memory
tier; a hit in a slower tier is promoted one tier up (DISK -> HOST -> DEVICE); evicting from
DEVICE demotes to HOST, evicting from HOST just drops the copy, and evicting from DISK removes
the entry (it would otherwise live only in volatile memory).

The LMDB file and its format, and the write-behind thread, are in lmdb_file.py; the host leases
of the NIXL path in leases.py; the records (entries, errors, tier counters) in records.py.
The index is rebuilt from LMDB at start. Bytes read from LMDB are verified; a mismatch (bit
flips, truncation, a missing value) drops the entry from every tier and LMDB and reports a miss. Memory-tier copies were verified when they entered
memory (from a Put, or from disk on promotion) and are served as they are.

Locks: `_wlock` serialises every LMDB write (LMDB has one writer anyway) and every structural
change that needs one; `_lock` guards the in-memory index and is held only for short, memory-only
sections. Order: `_wlock` before `_lock`, never the reverse.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterable, Sequence

import numpy as np
import structlog

from services.segcache.config import SegcacheConfig
from services.segcache.device_reads import DeviceLeases
from services.segcache.leases import HostLeases
from services.segcache.lmdb_file import LmdbFile, WriteBehind
from services.segcache.policy import make_policy
from services.segcache.records import (  # noqa: F401  (re-exported: the store's public names)
    TIER_DEVICE, TIER_DISK, TIER_HOST, TIER_MISS, TIER_NAMES, CacheFull, ChecksumMismatch, CorruptEntry, Entry,
    EntryInfo, EntryTooLarge, HostLease, InvalidRequest, PutResult, SegcacheError, TierState, as_array, checksum,
    check_entry_size, check_key, entry_format,
)

log = structlog.get_logger("segcache.store")


# ---- the store ----------------------------------------------------------------------------
class SegmentStore(HostLeases, DeviceLeases):
    def __init__(self, cfg: SegcacheConfig):
        self.cfg = cfg
        self._lock = threading.RLock()
        self._wlock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._pending: dict[str, np.ndarray] = {}  # write-behind: acknowledged, not yet in LMDB
        self.corrupt_dropped = 0
        self.put_conflicts = 0  # repeated Put of a key with different bytes (first write wins)
        self.staging_bytes = 0  # private lease copies outside the host tier
        self.leases_active = 0
        self.lookup_hits = {TIER_DEVICE: 0, TIER_HOST: 0, TIER_DISK: 0}
        self.lookup_misses = 0
        self._closed = False

        self._torch: Any = None
        self._cuda: Any = self._device_tier_device(cfg) if cfg.device_bytes > 0 else None  # None: tier 0 off
        self.device = TierState(TIER_DEVICE, cfg.device_bytes, self._cuda is not None, make_policy(cfg.policy))
        self.host = TierState(TIER_HOST, cfg.host_bytes, cfg.host_bytes > 0, make_policy(cfg.policy))
        self.disk = TierState(TIER_DISK, cfg.disk_bytes, True, make_policy(cfg.policy))
        self.tiers = (self.device, self.host, self.disk)

        self._lmdb, entries, bad = LmdbFile.open_checked(cfg)
        self._load_index(entries, bad)
        self._writer = None if cfg.write_through else WriteBehind(self._write_behind)

    # ---- start-up -------------------------------------------------------------------------
    def _device_tier_device(self, cfg: SegcacheConfig) -> Any:
        """The torch device of tier 0, or None (tier off) without CUDA. Its own method so that a
        test can stand a CPU device in for the GPU (tests/services/segcache/test_device_reads.py)."""
        try:
            import torch

            self._torch = torch
            if torch.cuda.is_available():
                return torch.device("cuda", cfg.device_index)
            log.info("device tier off: CUDA not available")
        except Exception as e:  # pragma: no cover - torch always importable here
            log.warning("device tier off", error=str(e))
        return None

    def _load_index(self, entries: list[Entry], bad: int) -> None:
        for e in entries:
            self._entries[e.key] = e
            self.disk.add(e.stored_len, e.format)
            self._track(e)
        self.corrupt_dropped += bad
        if self.disk.bytes > self.disk.budget:  # the budget shrank since the last run
            with self._wlock:
                with self._lock:
                    victims = self._disk_victims(0, strict=False)
                self._lmdb.commit(deletes=victims)
                log.warning("disk budget below stored bytes at start; evicted", entries=len(victims))
        self.disk.peak = self.disk.bytes
        log.info("index loaded", entries=len(self._entries), disk_bytes=self.disk.bytes)

    # ---- policy bookkeeping (caller holds _lock) ------------------------------------------
    def _track(self, e: Entry) -> None:
        """Put e into the policy of every tier it resides in, if it is evictable."""
        if not e.evictable:
            return
        if e.device is not None:
            self.device.policy.add(e.key, e.size, e.cost, e.freq)
        if e.host is not None:
            self.host.policy.add(e.key, e.size, e.cost, e.freq)
        if e.on_disk:
            self.disk.policy.add(e.key, e.stored_len, e.cost, e.freq)

    def _untrack(self, e: Entry) -> None:
        for t in self.tiers:
            t.policy.remove(e.key)

    def _touch(self, e: Entry) -> None:
        e.hits += 1
        for t in self.tiers:
            t.policy.touch(e.key, e.freq)

    # ---- memory tiers (caller holds _lock) ------------------------------------------------
    def _make_room(self, tier: TierState, need: int) -> bool:
        """Evict from tier until `need` more bytes fit; False (nothing evicted) if impossible."""
        if not tier.enabled or need > tier.budget:
            return False
        if tier.bytes - tier.policy.bytes + need > tier.budget:
            return False  # pinned / leased bytes leave too little room
        while tier.bytes + need > tier.budget:
            victim = tier.policy.pop_victim()
            if victim is None:  # cannot happen given the check above
                return False
            self._evict_memory(tier, self._entries[victim])
        return True

    def _evict_memory(self, tier: TierState, e: Entry) -> None:
        tier.evictions += 1
        if tier is self.device:
            tensor, e.device = e.device, None
            self.device.sub(e.size, e.format)
            host_copy = tensor.cpu().numpy()  # demote: device -> host
            self._place(e, host_copy, TIER_HOST)
        else:
            e.host = None
            self.host.sub(e.size, e.format)
        if not e.on_disk and e.key not in self._pending and e.host is None and e.device is None:
            # Write-behind entry whose only copy was this one: it is gone.
            self._forget(e)

    def _place(self, e: Entry, arr: np.ndarray, start: int) -> int:
        """Put e's bytes into the fastest memory tier at or below `start` that has room."""
        if start <= TIER_DEVICE and self.device.enabled and e.device is None and self._make_room(self.device, e.size):
            src = arr if arr.flags.writeable else arr.copy()
            e.device = self._torch.from_numpy(src).to(self._cuda)
            self.device.add(e.size, e.format)
            if e.evictable:
                self.device.policy.add(e.key, e.size, e.cost, e.freq)
            return TIER_DEVICE
        if self.host.enabled and e.host is None and self._make_room(self.host, e.size):
            e.host = arr
            self.host.add(e.size, e.format)
            if e.evictable:
                self.host.policy.add(e.key, e.size, e.cost, e.freq)
            return TIER_HOST
        return TIER_MISS

    def _forget(self, e: Entry) -> None:
        """Remove e from the index and every tier's accounting (not from LMDB)."""
        if e.deleted:
            return
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        self._untrack(e)
        e.deleted = True
        if e.device is not None:
            self.device.sub(e.size, e.format)
            e.device = None
        if e.host is not None:
            self.host.sub(0, e.format)  # the entry; its bytes go with its host buffer
            if e.leases == 0:
                self.host.sub(e.size, e.format, count=False)
                e.host = None
            # else: a leased host buffer stays alive (and its bytes counted) until release_host
        if e.on_disk:
            self.disk.sub(e.stored_len, e.format)
        self._pending.pop(e.key, None)

    def _disk_victims(self, need: int, *, strict: bool = True) -> list[Entry]:
        """Pick (and forget) disk victims so `need` more bytes fit. Raises CacheFull when the
        non-evictable bytes leave too little room (strict) -- nothing is evicted then."""
        d = self.disk
        if strict and d.bytes - d.policy.bytes + need > d.budget:
            raise CacheFull(f"disk tier: {d.bytes - d.policy.bytes} pinned/leased bytes of a "
                            f"{d.budget}-byte budget leave no room for {need} bytes")
        victims = []
        while d.bytes + need > d.budget:
            key = d.policy.pop_victim()
            if key is None:
                break
            e = self._entries[key]
            d.evictions += 1
            for t in (self.device, self.host):
                if (e.device if t is self.device else e.host) is not None:
                    t.evictions += 1
            self._forget(e)
            victims.append(e)
        return victims

    # ---- LMDB -----------------------------------------------------------------------------
    def _read_disk(self, e: Entry) -> np.ndarray:
        return self._lmdb.read(e)

    def _drop_corrupt(self, e: Entry, reason: str) -> None:
        with self._wlock:
            with self._lock:
                if self._entries.get(e.key) is not e:
                    return  # already deleted or replaced
                self._forget(e)
                self.corrupt_dropped += 1
            self._lmdb.delete_quietly([e])
        log.warning("corrupt entry dropped", key=e.key, reason=reason)

    # ---- validation -----------------------------------------------------------------------
    # ---- API ------------------------------------------------------------------------------
    def _info(self, e: Entry) -> EntryInfo:
        if e.device is not None:
            tier = TIER_DEVICE
        elif e.host is not None or e.key in self._pending:
            tier = TIER_HOST
        elif e.on_disk:
            tier = TIER_DISK
        else:
            tier = TIER_MISS
        return EntryInfo(e.key, tier, e.size, e.cost, e.tokens, e.fingerprint, e.digest, e.pinned)

    def put(self, key: str, data: Any, *, recompute_cost_s: float = 0.0, token_count: int = 0,
            model_fingerprint: str = "", pin: bool = False, expected_checksum: bytes = b"") -> PutResult:
        """Store an entry. Idempotent: if key is cached, nothing is written and created=False.
        With write_through (default) the entry is committed to LMDB before this returns."""
        check_key(key, self.cfg.max_key_bytes)
        if not (isinstance(recompute_cost_s, (int, float)) and math.isfinite(recompute_cost_s)
                and recompute_cost_s >= 0):
            raise InvalidRequest("recompute_cost_s must be a finite number >= 0")
        if not 0 <= int(token_count) < 2**32:
            raise InvalidRequest("token_count out of range")
        if len(model_fingerprint.encode()) > 1024:
            raise InvalidRequest("model_fingerprint longer than 1024 bytes")
        arr = as_array(data)
        check_entry_size(arr.nbytes, self.cfg)
        digest = checksum(arr)
        if expected_checksum and expected_checksum != digest:
            raise ChecksumMismatch("payload does not match the writer's checksum")
        e = Entry(key=key, size=arr.nbytes, cost=float(recompute_cost_s), tokens=int(token_count),
                  fingerprint=model_fingerprint, digest=digest, pinned=pin, format=entry_format(arr))
        with self._wlock:
            with self._lock:
                old = self._entries.get(key)
                if old is not None:
                    if old.digest != digest:
                        self.put_conflicts += 1
                        log.warning("put of a cached key with different bytes; kept the first", key=key)
                    return PutResult(self._info(old), created=False)
                victims = self._disk_victims(e.stored_len) if self.cfg.write_through else []
            if self.cfg.write_through:
                self._lmdb.commit(puts=[(e, arr)], deletes=victims)
            with self._lock:
                e.on_disk = self.cfg.write_through
                self._entries[key] = e
                if e.on_disk:
                    self.disk.add(e.stored_len, e.format)
                    if e.evictable:
                        self.disk.policy.add(key, e.stored_len, e.cost, e.freq)
                else:
                    self._pending[key] = arr
                self._place(e, arr, TIER_DEVICE)
                info = self._info(e)
        if self._writer is not None:
            self._writer.submit(key)
        return PutResult(info, created=True)

    def lookup(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        out: list[EntryInfo | None] = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    self.lookup_misses += 1
                    self._count_read(TIER_MISS)  # no tier holds it: a miss of every tier
                    out.append(None)
                else:
                    info = self._info(e)
                    self.lookup_hits[info.tier] = self.lookup_hits.get(info.tier, 0) + 1
                    out.append(info)
        return out

    def _count_read(self, tier: int) -> None:
        """A read answered by `tier` (TIER_MISS: by none): a hit there, a miss in each faster tier."""
        for t in self.tiers:
            if not t.enabled:
                continue
            if t.tier == tier:
                t.hits += 1
                return
            t.misses += 1

    def _entry_to_read(self, key: str) -> Entry | None:
        """key's entry, or None counted as a read that missed every tier (caller holds _lock)."""
        e = self._entries.get(key)
        if e is None:
            self._count_read(TIER_MISS)
        return e

    def _hit(self, e: Entry, tier: int) -> None:
        """A read of e answered by `tier` (caller holds _lock)."""
        self._count_read(tier)
        self._touch(e)

    def get(self, key: str) -> tuple[EntryInfo, np.ndarray] | None:
        """The entry's bytes from the fastest tier (a slower-tier hit is promoted), or None.
        A disk copy that fails verification is dropped everywhere and reported as None."""
        tensor = None
        with self._lock:
            e = self._entry_to_read(key)
            if e is None:
                return None
            if e.device is not None:
                self._hit(e, TIER_DEVICE)
                tensor, info = e.device, self._info(e)
            elif e.host is not None:
                self._hit(e, TIER_HOST)
                arr, info = e.host, self._info(e)
                if self.device.enabled and e.evictable:
                    self._promote(e, arr, self.device)
                return info, arr
            elif key in self._pending:
                self._hit(e, TIER_HOST)
                return self._info(e), self._pending[key]
        if tensor is not None:
            return info, tensor.cpu().numpy()
        return self._get_from_disk(e)

    def _promote(self, e: Entry, arr: np.ndarray, to: TierState) -> None:
        """Move e's memory copy up into `to` (caller holds _lock)."""
        if to is self.device:
            if self._place(e, arr, TIER_DEVICE) == TIER_DEVICE:
                self.device.promotions += 1
                if e.host is not None:  # exclusive tiers: the host copy goes
                    self.host.policy.remove(e.key)
                    self.host.sub(e.size, e.format)
                    e.host = None
        elif self._place(e, arr, TIER_HOST) != TIER_MISS:
            to.promotions += 1

    def _get_from_disk(self, e: Entry) -> tuple[EntryInfo, np.ndarray] | None:
        try:
            arr = self._read_disk(e)
        except CorruptEntry as exc:
            with self._lock:
                current = self._entries.get(e.key) is e
                if current:
                    self._count_read(TIER_MISS)
            if current:
                self._drop_corrupt(e, str(exc))
                return None
            return self.get(e.key) if e.key in self._entries else None
        with self._lock:
            info = self._info(e)  # the tier that answered, before any promotion
            if self._entries.get(e.key) is e:
                self._hit(e, TIER_DISK)
                if e.host is None and e.device is None and e.evictable:
                    self._promote(e, arr, self.host)
            return info, arr

    def delete(self, keys: Iterable[str]) -> int:
        with self._wlock:
            with self._lock:
                gone = [e for e in map(self._entries.get, dict.fromkeys(keys)) if e is not None]
                on_disk = [e for e in gone if e.on_disk]
                for e in gone:
                    self._forget(e)
            if on_disk:
                self._lmdb.commit(deletes=on_disk)
        return len(gone)

    def pin(self, keys: Iterable[str], pinned: bool = True) -> tuple[int, list[str]]:
        """Pin (never evicted from any tier it is in) or unpin. Returns (updated, missing)."""
        updated, missing, persist = 0, [], []
        with self._wlock:
            with self._lock:
                for k in dict.fromkeys(keys):
                    e = self._entries.get(k)
                    if e is None:
                        missing.append(k)
                        continue
                    updated += 1
                    if e.pinned == pinned:
                        continue
                    e.pinned = pinned
                    if pinned:
                        self._untrack(e)
                    else:
                        self._track(e)
                    if e.on_disk:
                        persist.append(e)
            if persist:
                self._lmdb.commit(meta_only=persist)
        return updated, missing

    # ---- write-behind (the WriteBehind thread calls this) -------------------------------
    def _write_behind(self, key: str) -> None:
        with self._wlock:
            with self._lock:
                e = self._entries.get(key)
                arr = self._pending.get(key)
                if e is None or arr is None or e.on_disk:
                    self._pending.pop(key, None)
                    return
                try:
                    victims = self._disk_victims(e.stored_len)
                except CacheFull:
                    self._pending.pop(key, None)
                    if e.host is None and e.device is None:
                        self._forget(e)
                    log.error("write-behind: no disk room; entry stays memory-only", key=key)
                    return
            self._lmdb.commit(puts=[(e, arr)], deletes=victims)
            with self._lock:
                self._pending.pop(key, None)
                if self._entries.get(key) is not e:  # deleted meanwhile
                    self._lmdb.commit(deletes=[e])
                    return
                e.on_disk = True
                self.disk.add(e.stored_len, e.format)
                if e.evictable:
                    self.disk.policy.add(key, e.stored_len, e.cost, e.freq)

    def flush(self) -> None:
        """Wait until every write-behind entry is in LMDB (no-op when write-through)."""
        if self._writer is not None:
            self._writer.flush()

    # ---- stats / lifecycle ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": [t.as_dict() for t in self.tiers],
                "formats": {(t.name, f): list(v) for t in self.tiers for f, v in t.formats.items()},
                "entries": len(self._entries),
                "pinned": sum(1 for e in self._entries.values() if e.pinned),
                "corrupt_dropped": self.corrupt_dropped,
                "put_conflicts": self.put_conflicts,
                "policy": self.cfg.policy,
                "leases_active": self.leases_active,
                "staging_bytes": self.staging_bytes,
                "pending_writes": len(self._pending),
                "lookup_hits": {TIER_NAMES[t]: n for t, n in self.lookup_hits.items()},
                "lookup_misses": self.lookup_misses,
            }

    def tier_of(self, key: str) -> int:
        with self._lock:
            e = self._entries.get(key)
            return TIER_MISS if e is None else self._info(e).tier

    def policy_order(self, tier: int) -> list[str]:
        """Evictable keys of a tier in eviction order (tests, debugging)."""
        with self._lock:
            return {t.tier: t for t in self.tiers}[tier].policy.order()

    def close(self) -> None:
        if self._closed:
            return
        if self._writer is not None:
            self._writer.close()
        self._closed = True
        self._lmdb.close()

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
