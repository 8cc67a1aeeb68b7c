"""The tiered segment store: tiers, eviction, LMDB persistence and checksums (no gRPC here).

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

LMDB holds two databases, written in one transaction per Put:
  data: key -> 32-byte header (magic "HSC1", version, payload length, 16-byte digest) + payload
  meta: key -> size, recompute cost, token count, pin flag, digest, model fingerprint
The index is rebuilt from `meta` at start. Bytes read from LMDB are verified against the header
and the meta digest; a mismatch (bit flips, truncation, a missing value) drops the entry from
every tier and LMDB and reports a miss. Memory-tier copies were verified when they entered
memory (from a Put, or from disk on promotion) and are served as they are.

Locks: `_wlock` serialises every LMDB write (LMDB has one writer anyway) and every structural
change that needs one; `_lock` guards the in-memory index and is held only for short, memory-only
sections. Order: `_wlock` before `_lock`, never the reverse.
"""

from __future__ import annotations

import math
import queue
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import lmdb
import numpy as np
import structlog

from common.checksum import DIGEST_BYTES, checksum  # noqa: F401  (re-exported)
from services.segcache.config import SegcacheConfig
from services.segcache.policy import Policy, make_policy

TIER_MISS, TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2, 3
TIER_NAMES = {TIER_MISS: "miss", TIER_DEVICE: "device", TIER_HOST: "host", TIER_DISK: "disk"}

MAGIC = b"HSC1"
FORMAT_VERSION = 2  # 2: XXH3-128 digests (common.checksum); version 1 (blake2b) records read as corrupt
# magic, version, flags, payload length, digest
HEADER = struct.Struct("<4sHHQ16s")
# version, flags (bit 0: pinned), pad, token count, size, recompute cost, digest; fingerprint follows
META = struct.Struct("<BBxxIQd16s")
META_PINNED = 1

log = structlog.get_logger("segcache.store")


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

    @property
    def stored_len(self) -> int:
        return HEADER.size + self.size

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

    def add(self, n: int) -> None:
        self.bytes += n
        self.entries += 1
        if self.bytes > self.peak:
            self.peak = self.bytes

    def sub(self, n: int, count: bool = True) -> None:
        self.bytes -= n
        if count:
            self.entries -= 1

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "name": self.name, "enabled": self.enabled,
                "budget_bytes": self.budget if self.enabled else 0, "bytes": self.bytes,
                "peak_bytes": self.peak, "entries": self.entries, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions,
                "promotions": self.promotions}


def _as_array(data: Any) -> np.ndarray:
    """A 1-D uint8 array the store may keep: bytes/bytearray/ndarray are adopted without a
    copy (the caller must not mutate them afterwards); anything else is copied."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if isinstance(data, (bytes, bytearray)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.frombuffer(bytes(memoryview(data).cast("B")), dtype=np.uint8)


def _encode_meta(e: Entry) -> bytes:
    flags = META_PINNED if e.pinned else 0
    return META.pack(FORMAT_VERSION, flags, e.tokens, e.size, e.cost, e.digest) + e.fingerprint.encode()


def _decode_meta(key: str, raw: bytes) -> Entry:
    if len(raw) < META.size:
        raise CorruptEntry("short meta record")
    version, flags, tokens, size, cost, digest = META.unpack_from(raw)
    if version != FORMAT_VERSION or size <= 0 or not math.isfinite(cost):
        raise CorruptEntry("bad meta record")
    fp = bytes(raw[META.size:]).decode("utf-8")
    return Entry(key=key, size=size, cost=cost, tokens=tokens, fingerprint=fp, digest=digest,
                 pinned=bool(flags & META_PINNED), on_disk=True)


def encode_value(arr: np.ndarray, digest: bytes) -> bytearray:
    """The LMDB value: fixed header + payload, in one buffer (one LMDB value, one commit)."""
    value = bytearray(HEADER.size + arr.nbytes)
    HEADER.pack_into(value, 0, MAGIC, FORMAT_VERSION, 0, arr.nbytes, digest)
    np.frombuffer(value, dtype=np.uint8, offset=HEADER.size)[:] = arr
    return value


def decode_value(buf: Any, expect_size: int, expect_digest: bytes) -> np.ndarray:
    """Verify an LMDB value and copy its payload out (buf may be a zero-copy LMDB buffer)."""
    mv = memoryview(buf)
    if len(mv) < HEADER.size:
        raise CorruptEntry("value shorter than its header")
    magic, version, _flags, length, digest = HEADER.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry("bad magic/version")
    if length != expect_size or len(mv) != HEADER.size + length:
        raise CorruptEntry(f"length mismatch (header {length}, value {len(mv) - HEADER.size}, meta {expect_size})")
    if digest != expect_digest:
        raise CorruptEntry("header digest differs from meta digest")
    payload = mv[HEADER.size:]
    if checksum(payload) != digest:
        raise CorruptEntry("payload checksum mismatch")
    out = np.empty(length, dtype=np.uint8)
    out[:] = np.frombuffer(payload, dtype=np.uint8)
    return out


# ---- the store ----------------------------------------------------------------------------
class SegmentStore:
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
        self._cuda: Any = None
        device_on = False
        if cfg.device_bytes > 0:
            try:
                import torch

                if torch.cuda.is_available():
                    self._torch = torch
                    self._cuda = torch.device("cuda", cfg.device_index)
                    device_on = True
                else:
                    log.info("device tier off: CUDA not available")
            except Exception as e:  # pragma: no cover - torch always importable here
                log.warning("device tier off", error=str(e))
        self.device = TierState(TIER_DEVICE, cfg.device_bytes, device_on, make_policy(cfg.policy))
        self.host = TierState(TIER_HOST, cfg.host_bytes, cfg.host_bytes > 0, make_policy(cfg.policy))
        self.disk = TierState(TIER_DISK, cfg.disk_bytes, True, make_policy(cfg.policy))
        self.tiers = (self.device, self.host, self.disk)

        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(cfg.data_dir), map_size=cfg.map_size, max_dbs=4, subdir=True,
                              sync=cfg.lmdb_sync, metasync=cfg.lmdb_sync, readahead=False,
                              max_readers=512)
        self._data_db = self._env.open_db(b"data")
        self._meta_db = self._env.open_db(b"meta")
        self._load_index()

        self._queue: queue.Queue[str | None] | None = None
        self._writer: threading.Thread | None = None
        if not cfg.write_through:
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._writer_loop, name="segcache-writer", daemon=True)
            self._writer.start()

    # ---- start-up -------------------------------------------------------------------------
    def _load_index(self) -> None:
        bad: list[bytes] = []
        with self._env.begin() as txn:
            for kb, raw in txn.cursor(db=self._meta_db):
                try:
                    e = _decode_meta(kb.decode("utf-8"), raw)
                except (CorruptEntry, UnicodeDecodeError, struct.error):
                    bad.append(bytes(kb))
                    continue
                self._entries[e.key] = e
            orphans = [bytes(k) for k in txn.cursor(db=self._data_db).iternext(keys=True, values=False)
                       if bytes(k).decode("utf-8", "replace") not in self._entries]
        for e in self._entries.values():
            self.disk.add(e.stored_len)
            self._track(e)
        if bad or orphans:
            with self._env.begin(write=True) as txn:
                for kb in bad + orphans:
                    txn.delete(kb, db=self._meta_db)
                    txn.delete(kb, db=self._data_db)
            self.corrupt_dropped += len(bad)
            log.warning("dropped unreadable records at start", bad_meta=len(bad), orphans=len(orphans))
        if self.disk.bytes > self.disk.budget:  # the budget shrank since the last run
            with self._wlock:
                with self._lock:
                    victims = self._disk_victims(0, strict=False)
                self._lmdb_commit(deletes=victims)
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
            self.device.sub(e.size)
            host_copy = tensor.cpu().numpy()  # demote: device -> host
            self._place(e, host_copy, TIER_HOST)
        else:
            e.host = None
            self.host.sub(e.size)
        if not e.on_disk and e.key not in self._pending and e.host is None and e.device is None:
            # Write-behind entry whose only copy was this one: it is gone.
            self._forget(e)

    def _place(self, e: Entry, arr: np.ndarray, start: int) -> int:
        """Put e's bytes into the fastest memory tier at or below `start` that has room."""
        if start <= TIER_DEVICE and self.device.enabled and e.device is None and self._make_room(self.device, e.size):
            src = arr if arr.flags.writeable else arr.copy()
            e.device = self._torch.from_numpy(src).to(self._cuda)
            self.device.add(e.size)
            if e.evictable:
                self.device.policy.add(e.key, e.size, e.cost, e.freq)
            return TIER_DEVICE
        if self.host.enabled and e.host is None and self._make_room(self.host, e.size):
            e.host = arr
            self.host.add(e.size)
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
            self.device.sub(e.size)
            e.device = None
        if e.host is not None:
            self.host.entries -= 1
            if e.leases == 0:
                self.host.bytes -= e.size
                e.host = None
            # else: a leased host buffer stays alive (and its bytes counted) until release_host
        if e.on_disk:
            self.disk.sub(e.stored_len)
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
    def _lmdb_commit(self, puts: Sequence[tuple[Entry, np.ndarray]] = (),
                     deletes: Iterable[Entry] = (), meta_only: Sequence[Entry] = ()) -> None:
        """One write transaction (caller holds _wlock)."""
        deletes = list(deletes)
        try:
            with self._env.begin(write=True) as txn:
                for e in deletes:
                    kb = e.key.encode()
                    txn.delete(kb, db=self._data_db)
                    txn.delete(kb, db=self._meta_db)
                for e, arr in puts:
                    kb = e.key.encode()
                    txn.put(kb, encode_value(arr, e.digest), db=self._data_db)
                    txn.put(kb, _encode_meta(e), db=self._meta_db)
                for e in meta_only:
                    txn.put(e.key.encode(), _encode_meta(e), db=self._meta_db)
        except lmdb.MapFullError as exc:
            if puts and deletes:  # still apply the evictions already made in the index
                self._lmdb_commit(deletes=deletes)
            raise CacheFull(f"LMDB map full ({self.cfg.map_size} bytes); raise lmdb_map_bytes") from exc

    def _read_disk(self, e: Entry) -> np.ndarray:
        with self._env.begin(db=self._data_db, buffers=True) as txn:
            buf = txn.get(e.key.encode())
            if buf is None:
                raise CorruptEntry("value missing")
            return decode_value(buf, e.size, e.digest)

    def _drop_corrupt(self, e: Entry, reason: str) -> None:
        with self._wlock:
            with self._lock:
                if self._entries.get(e.key) is not e:
                    return  # already deleted or replaced
                self._forget(e)
                self.corrupt_dropped += 1
            self._lmdb_commit(deletes=[e])
        log.warning("corrupt entry dropped", key=e.key, reason=reason)

    # ---- validation -----------------------------------------------------------------------
    def validate_key(self, key: Any) -> str:
        if not isinstance(key, str) or not key:
            raise InvalidRequest("key must be a non-empty string")
        n = len(key.encode("utf-8"))
        if n > self.cfg.max_key_bytes:
            raise InvalidRequest(f"key is {n} bytes; the limit is {self.cfg.max_key_bytes}")
        if "\x00" in key:
            raise InvalidRequest("key must not contain NUL")
        return key

    def check_size(self, size: int) -> None:
        if size <= 0:
            raise InvalidRequest("entry size must be > 0")
        limit = self.cfg.entry_limit
        if size > limit:
            raise EntryTooLarge(f"entry of {size} bytes exceeds the {limit}-byte limit "
                                f"(host {self.cfg.host_bytes}, disk {self.cfg.disk_bytes}, "
                                f"max_entry {self.cfg.max_entry_bytes or 'auto'})")

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
        self.validate_key(key)
        if not (isinstance(recompute_cost_s, (int, float)) and math.isfinite(recompute_cost_s)
                and recompute_cost_s >= 0):
            raise InvalidRequest("recompute_cost_s must be a finite number >= 0")
        if not 0 <= int(token_count) < 2**32:
            raise InvalidRequest("token_count out of range")
        if len(model_fingerprint.encode()) > 1024:
            raise InvalidRequest("model_fingerprint longer than 1024 bytes")
        arr = _as_array(data)
        self.check_size(arr.nbytes)
        digest = checksum(arr)
        if expected_checksum and expected_checksum != digest:
            raise ChecksumMismatch("payload does not match the writer's checksum")
        e = Entry(key=key, size=arr.nbytes, cost=float(recompute_cost_s), tokens=int(token_count),
                  fingerprint=model_fingerprint, digest=digest, pinned=pin)
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
                self._lmdb_commit(puts=[(e, arr)], deletes=victims)
            with self._lock:
                e.on_disk = self.cfg.write_through
                self._entries[key] = e
                if e.on_disk:
                    self.disk.add(e.stored_len)
                    if e.evictable:
                        self.disk.policy.add(key, e.stored_len, e.cost, e.freq)
                else:
                    self._pending[key] = arr
                self._place(e, arr, TIER_DEVICE)
                info = self._info(e)
        if self._queue is not None:
            self._queue.put(key)
        return PutResult(info, created=True)

    def lookup(self, keys: Sequence[str]) -> list[EntryInfo | None]:
        out: list[EntryInfo | None] = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    self.lookup_misses += 1
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

    def get(self, key: str) -> tuple[EntryInfo, np.ndarray] | None:
        """The entry's bytes from the fastest tier (a slower-tier hit is promoted), or None.
        A disk copy that fails verification is dropped everywhere and reported as None."""
        tensor = None
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                self._count_read(TIER_MISS)
                return None
            if e.device is not None:
                self._count_read(TIER_DEVICE)
                self._touch(e)
                tensor, info = e.device, self._info(e)
            elif e.host is not None:
                self._count_read(TIER_HOST)
                self._touch(e)
                arr, info = e.host, self._info(e)
                if self.device.enabled and e.evictable:
                    self._promote(e, arr, self.device)
                return info, arr
            elif key in self._pending:
                self._count_read(TIER_HOST)
                self._touch(e)
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
                    self.host.sub(e.size)
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
                self._count_read(TIER_DISK)
                self._touch(e)
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
                self._lmdb_commit(deletes=on_disk)
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
                self._lmdb_commit(meta_only=persist)
        return updated, missing

    # ---- leases (the NIXL path) -----------------------------------------------------------
    def _lease_host(self, e: Entry, arr: np.ndarray, staged: bool) -> HostLease:
        e.leases += 1
        if e.leases == 1:
            self._untrack(e)
        if staged:
            self.staging_bytes += e.size
        self.leases_active += 1
        return HostLease(e, arr, staged)

    def acquire_host(self, key: str) -> HostLease | None:
        """Make key's bytes available in host memory for a remote reader and pin them there
        until release_host(). Counts as a read. None on a miss (or a corrupt disk copy)."""
        tensor = None
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                self._count_read(TIER_MISS)
                return None
            if e.host is not None:
                self._count_read(TIER_HOST)
                self._touch(e)
                return self._lease_host(e, e.host, staged=False)
            if key in self._pending:
                self._count_read(TIER_HOST)
                self._touch(e)
                return self._lease_host(e, self._pending[key], staged=True)
            if e.device is not None:
                self._count_read(TIER_DEVICE)
                self._touch(e)
                tensor = e.device
        if tensor is not None:
            arr = tensor.cpu().numpy()
            with self._lock:
                return self._lease_host(e, arr, staged=True)
        got = self._get_from_disk(e)
        if got is None:
            return None
        with self._lock:
            cur = self._entries.get(key)
            if cur is e and e.host is not None:
                return self._lease_host(e, e.host, staged=False)
            return self._lease_host(e, got[1], staged=True)

    def release_host(self, lease: HostLease) -> None:
        with self._lock:
            e = lease.entry
            e.leases -= 1
            self.leases_active -= 1
            if lease.staged:
                self.staging_bytes -= e.size
            if e.leases == 0:
                if e.deleted:
                    if e.host is not None:  # the deleted entry's host buffer is freed now
                        self.host.sub(e.size, count=False)
                        e.host = None
                elif self._entries.get(e.key) is e:
                    self._track(e)

    # ---- write-behind -----------------------------------------------------------------------
    def _writer_loop(self) -> None:
        assert self._queue is not None
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write_behind(key)
            except Exception as exc:  # keep the writer alive
                log.error("write-behind failed", key=key, error=str(exc))
            finally:
                self._queue.task_done()

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
            self._lmdb_commit(puts=[(e, arr)], deletes=victims)
            with self._lock:
                self._pending.pop(key, None)
                if self._entries.get(key) is not e:  # deleted meanwhile
                    self._lmdb_commit(deletes=[e])
                    return
                e.on_disk = True
                self.disk.add(e.stored_len)
                if e.evictable:
                    self.disk.policy.add(key, e.stored_len, e.cost, e.freq)

    def flush(self) -> None:
        """Wait until every write-behind entry is in LMDB (no-op when write-through)."""
        if self._queue is not None:
            self._queue.join()

    # ---- stats / lifecycle ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": [t.as_dict() for t in self.tiers],
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
        if self._queue is not None:
            self._queue.put(None)
            if self._writer is not None:
                self._writer.join()
        self._closed = True
        self._env.close()

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
