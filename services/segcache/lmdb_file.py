"""The segment store's persistence: its LMDB file and the write-behind thread (no tiers here).

LMDB holds two databases, written in one transaction per commit:
  data: key -> 32-byte header (magic "HSC1", version, payload length, XXH3-128 digest, common/engine/checksum.py) + payload
  meta: key -> size, recompute cost, token count, pin flag, entry format, digest, model fingerprint, and (format
        2) a blake2b-64 of the key and all of that, so that a damaged record is dropped alone
        instead of being believed (a flipped size bit once drove the eviction of 42 good entries)
The index is rebuilt from `meta` at start (`LmdbFile.open_checked`). Bytes read back are verified
against the header and the meta digest; a mismatch, or any LMDB error on read, raises CorruptEntry.
A damaged file at start is moved aside (lmdb_check.py).
"""

from __future__ import annotations

import hashlib
import math
import queue
import struct
import threading
from typing import Any, Callable, Iterable, Sequence

import lmdb
import numpy as np
import structlog

from services.segcache.config import SegcacheConfig
from services.segcache.lmdb_check import damage, move_aside
from services.segcache.records import HEADER_BYTES, CacheFull, CorruptEntry, Entry, checksum, entry_format

MAGIC = b"HSC1"
FORMAT_VERSION = 2  # 2: XXH3-128 digests (common.engine.checksum); version 1 (blake2b) records read as corrupt
# magic, version, flags, payload length, digest
HEADER = struct.Struct("<4sHHQ16s")
assert HEADER.size == HEADER_BYTES
# version, flags (bit 0: pinned), entry format code, pad, token count, size, recompute cost, digest;
# fingerprint follows. The format byte was padding before (0 there: not recorded, read from the
# entry's header at start); readers that predate it skip it, and the record digest covers it.
META = struct.Struct("<BBBxIQd16s")
META_PINNED = 1
FORMAT_CODES = {"fp32": 1, "bf16": 2, "fp8": 3, "fp8t": 4, "other": 255}  # a new format needs a new code here
FORMAT_OF_CODE = {c: f for f, c in FORMAT_CODES.items()}
META_VERSION = 2  # format 1 records (no checksum) are still read
META_DIGEST_BYTES = 8

log = structlog.get_logger("segcache.store")


# ---- the on-disk format -------------------------------------------------------------------
def _meta_digest(key: str, body: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + b"\0" + body, digest_size=META_DIGEST_BYTES).digest()


def encode_meta(e: Entry) -> bytes:
    flags = META_PINNED if e.pinned else 0
    code = FORMAT_CODES.get(e.format, FORMAT_CODES["other"])
    body = META.pack(META_VERSION, flags, code, e.tokens, e.size, e.cost, e.digest) + e.fingerprint.encode()
    return body + _meta_digest(e.key, body)


def decode_meta(key: str, raw: bytes) -> Entry:
    raw = bytes(raw)
    if len(raw) < META.size:
        raise CorruptEntry("short meta record")
    version, flags, code, tokens, size, cost, digest = META.unpack_from(raw)
    if version == META_VERSION:
        body, check = raw[:-META_DIGEST_BYTES], raw[-META_DIGEST_BYTES:]
        if len(body) < META.size or _meta_digest(key, body) != check:
            raise CorruptEntry("meta record checksum mismatch")
    elif version == FORMAT_VERSION:
        body = raw  # written before records had a checksum
    else:
        raise CorruptEntry(f"meta record version {version}")
    if size <= 0 or not math.isfinite(cost) or cost < 0 or flags & ~META_PINNED:
        raise CorruptEntry("bad meta record")
    fp = body[META.size:].decode("utf-8")
    return Entry(key=key, size=size, cost=cost, tokens=tokens, fingerprint=fp, digest=digest,
                 pinned=bool(flags & META_PINNED), on_disk=True, format=FORMAT_OF_CODE.get(code, ""))


def payload_buffer(size: int) -> np.ndarray:
    """An uninitialised buffer for `size` payload bytes with room for the value header in front,
    so that `encode_value` frames it in place: a write-through Put's commit then holds the entry
    twice (its buffer and LMDB's dirty pages), not three times (issue 30)."""
    return np.empty(HEADER.size + size, dtype=np.uint8)[HEADER.size:]


def _framing_room(arr: np.ndarray) -> np.ndarray | None:
    """The whole buffer `arr` was cut from by payload_buffer; None when it was not."""
    base = arr.base
    if not (isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1
            and base.flags.c_contiguous and base.flags.writeable and arr.dtype == np.uint8
            and arr.ndim == 1 and base.nbytes == HEADER.size + arr.nbytes
            and arr.ctypes.data == base.ctypes.data + HEADER.size):
        return None
    return base


def encode_value(arr: np.ndarray, digest: bytes) -> bytearray | memoryview:
    """The LMDB value: fixed header + payload, in one buffer (one LMDB value, one commit).
    A payload_buffer gets its header written in front of it, no copy; any other array is copied
    after a header (the reference the framed path is tested against)."""
    framed = _framing_room(arr)
    if framed is not None:
        HEADER.pack_into(framed, 0, MAGIC, FORMAT_VERSION, 0, arr.nbytes, digest)
        return memoryview(framed)
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



# ---- the file -----------------------------------------------------------------------------
class LmdbFile:
    """The store's LMDB environment and its two databases. Writes: the caller serialises them
    (the store's `_wlock`; LMDB has one writer anyway)."""

    def __init__(self, cfg: SegcacheConfig):
        self.map_size = cfg.map_size
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(cfg.data_dir), map_size=cfg.map_size, max_dbs=4, subdir=True,
                             sync=cfg.lmdb_sync, metasync=cfg.lmdb_sync, readahead=False,
                             max_readers=512)
        self.data_db = self.env.open_db(b"data")
        self.meta_db = self.env.open_db(b"meta")

    @classmethod
    def open_checked(cls, cfg: SegcacheConfig) -> tuple["LmdbFile", list[Entry], int]:
        """The store's file and its index (`load_index`). A damaged file (lmdb_check.damage, an
        environment LMDB refuses, an index it cannot read) is moved aside and an empty one opened."""
        reason = damage(cfg.data_dir)
        if reason is None:
            try:
                f = cls(cfg)
            except lmdb.Error as e:
                reason = f"LMDB refused it: {type(e).__name__}: {e}"
            else:
                try:
                    return (f, *f.load_index())
                except lmdb.Error as e:
                    f.close()
                    reason = f"its index cannot be read: {type(e).__name__}: {e}"
        move_aside(cfg.data_dir, reason)
        f = cls(cfg)
        return (f, *f.load_index())

    def load_index(self) -> tuple[list[Entry], int]:
        """(every readable entry, the number of unreadable meta records). Unreadable records and
        data values without a meta record are deleted."""
        entries: dict[str, Entry] = {}
        bad: list[bytes] = []
        with self.env.begin() as txn:
            for kb, raw in txn.cursor(db=self.meta_db):
                try:
                    e = decode_meta(kb.decode("utf-8"), raw)
                    if e.stored_len > self.map_size:
                        raise CorruptEntry("size beyond the map")
                except (CorruptEntry, UnicodeDecodeError, struct.error):
                    bad.append(bytes(kb))
                    continue
                entries[e.key] = e
            orphans = [bytes(k) for k in txn.cursor(db=self.data_db).iternext(keys=True, values=False)
                       if bytes(k).decode("utf-8", "replace") not in entries]
        self._read_formats([e for e in entries.values() if not e.format])
        if bad or orphans:
            with self.env.begin(write=True) as txn:
                for kb in bad + orphans:
                    txn.delete(kb, db=self.meta_db)
                    txn.delete(kb, db=self.data_db)
            log.warning("dropped unreadable records at start", bad_meta=len(bad), orphans=len(orphans))
        return list(entries.values()), len(bad)

    def _read_formats(self, entries: Sequence[Entry]) -> None:
        """The format of entries whose meta record predates the format byte, from the header of
        their bytes (a zero-copy view: only the header's pages are touched)."""
        with self.env.begin(db=self.data_db, buffers=True) as txn:
            for e in entries:
                buf = txn.get(e.key.encode())
                e.format = entry_format(memoryview(buf)[HEADER.size:]) if buf is not None else "other"

    def commit(self, puts: Sequence[tuple[Entry, np.ndarray]] = (),
               deletes: Iterable[Entry] = (), meta_only: Sequence[Entry] = ()) -> None:
        """One write transaction."""
        deletes = list(deletes)
        try:
            with self.env.begin(write=True) as txn:
                for e in deletes:
                    kb = e.key.encode()
                    txn.delete(kb, db=self.data_db)
                    txn.delete(kb, db=self.meta_db)
                for e, arr in puts:
                    kb = e.key.encode()
                    txn.put(kb, encode_value(arr, e.digest), db=self.data_db)
                    txn.put(kb, encode_meta(e), db=self.meta_db)
                for e in meta_only:
                    txn.put(e.key.encode(), encode_meta(e), db=self.meta_db)
        except lmdb.MapFullError as exc:
            if puts and deletes:  # still apply the evictions already made in the index
                self.commit(deletes=deletes)
            raise CacheFull(f"LMDB map full ({self.map_size} bytes); raise lmdb_map_bytes") from exc

    def read(self, e: Entry) -> np.ndarray:
        """e's payload, verified (CorruptEntry otherwise, also for any LMDB error)."""
        try:
            with self.env.begin(db=self.data_db, buffers=True) as txn:
                buf = txn.get(e.key.encode())
                if buf is None:
                    raise CorruptEntry("value missing")
                return decode_value(buf, e.size, e.digest)
        except lmdb.Error as exc:
            raise CorruptEntry(f"LMDB: {type(exc).__name__}: {exc}") from None

    def delete_quietly(self, entries: Sequence[Entry]) -> None:
        """Delete damaged entries; an LMDB error here (the damage itself) is logged, not raised:
        they are gone from the index already."""
        try:
            self.commit(deletes=entries)
        except (lmdb.Error, CacheFull) as exc:
            log.error("could not delete damaged entries from LMDB", keys=[e.key for e in entries],
                      error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.env.close()


# ---- write-behind -------------------------------------------------------------------------
class WriteBehind:
    """The write-behind thread: keys submitted by Put are written by `write(key)`, one at a
    time, in order (write_through=False)."""

    def __init__(self, write: Callable[[str], None]):
        self._write = write
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="segcache-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str) -> None:
        self._queue.put(key)

    def flush(self) -> None:
        """Wait until every submitted key is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            except Exception as exc:  # keep the writer alive
                log.error("write-behind failed", key=key, error=str(exc))
            finally:
                self._queue.task_done()
