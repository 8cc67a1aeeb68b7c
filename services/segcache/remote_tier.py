"""The shared remote tier below LMDB: Mooncake Store (`mooncake.store.MooncakeDistributedStore`).

Every segcache that is given `--remote-url mooncake://HOST:PORT` (the master's RPC address)
writes its new entries behind to the store and, on a local miss, asks the store. Semantics:

- write-behind: a bounded queue drained by one thread; a full queue drops the write (counted),
  never blocks a Put; nothing is written while the master is down.
- read: batched `batch_is_exist` for Lookup, one `get` for Get; the object carries the entry's
  metadata and blake2b digest, verified before use: empty bytes (a vanished writer), short,
  foreign or corrupt objects are misses, never answers.
- master down: a health thread probes the master's TCP port every `health_period_s`; while it
  does not answer the tier is absent (every call returns "miss" at once, no multi-second waits).

Object layout: b"HRT1" | u32 metadata length | metadata JSON | payload.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlsplit

import numpy as np
import structlog

from services.segcache.records import checksum

log = structlog.get_logger("segcache.remote")

MAGIC = b"HRT1"
HEAD = struct.Struct("<4sI")
SCHEMES = ("mooncake",)


def parse_remote_url(url: str) -> tuple[str, int]:
    """'mooncake://host:port' -> (host, port); ValueError on anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in SCHEMES:
        raise ValueError(f"remote_url must be mooncake://HOST:PORT, not {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536 or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username:
        raise ValueError(f"remote_url must be mooncake://HOST:PORT, not {url!r}")
    return parts.hostname, port


@dataclass
class RemoteEntry:
    key: str
    data: np.ndarray
    recompute_cost_s: float
    token_count: int
    model_fingerprint: str
    checksum: bytes


def pack(key: str, data: Any, *, recompute_cost_s: float, token_count: int,
         model_fingerprint: str, digest: bytes) -> bytes:
    mv = memoryview(data).cast("B")
    meta = json.dumps({"key": key, "size": len(mv), "checksum": digest.hex(),
                       "recompute_cost_s": recompute_cost_s, "token_count": token_count,
                       "model_fingerprint": model_fingerprint}).encode()
    return HEAD.pack(MAGIC, len(meta)) + meta + bytes(mv)


def unpack(key: str, blob: bytes) -> RemoteEntry | None:
    """The verified entry, or None (empty, short, foreign or corrupt bytes)."""
    try:
        if len(blob) < HEAD.size:
            return None
        magic, n = HEAD.unpack_from(blob)
        if magic != MAGIC or HEAD.size + n > len(blob):
            return None
        meta = json.loads(blob[HEAD.size:HEAD.size + n])
        payload = np.frombuffer(blob, dtype=np.uint8, offset=HEAD.size + n)
        digest = bytes.fromhex(meta["checksum"])
        if meta["key"] != key or meta["size"] != payload.size or payload.size == 0 \
                or checksum(payload) != digest:
            return None
        return RemoteEntry(key, payload.copy(), float(meta["recompute_cost_s"]),
                           int(meta["token_count"]), str(meta["model_fingerprint"]), digest)
    except (ValueError, KeyError, TypeError, struct.error):
        return None


class MooncakeTier:
    def __init__(self, url: str, *, queue_entries: int = 256, segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20, health_period_s: float = 0.5,
                 local_host: str = "127.0.0.1", bind_host: str | None = None):
        self.host, self.port = parse_remote_url(url)
        self.url = url
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.health_period_s = health_period_s
        self.local_host = local_host  # what peers dial (the advertise address)
        self.bind_host = local_host if bind_host is None else bind_host  # what we listen on
        self._queue: queue.Queue = queue.Queue(maxsize=queue_entries)
        self._store: Any = None
        self._lock = threading.Lock()  # setup / teardown of the client
        self._up = False
        self._last_error = ""
        self._stop = threading.Event()
        self.written = self.dropped = self.write_errors = 0
        self.hits = self.misses = self.rejected = 0
        self._threads = [threading.Thread(target=self._health_loop, name="remote-health", daemon=True),
                         threading.Thread(target=self._write_loop, name="remote-write", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- health ------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._up and self._store is not None

    def _master_answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore  # the wheel is optional
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.bind_host)
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_host, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes,
                         "tcp", "", f"{self.host}:{self.port}")
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed ({rc})")
        self._store = store

    def _health_loop(self) -> None:
        while not self._stop.is_set():
            up = self._master_answers()
            if up and self._store is None:
                with self._lock:
                    try:
                        self._connect()
                        log.info("remote tier connected", url=self.url)
                    except Exception as e:  # ImportError, setup failure: stays absent
                        up = False
                        why = f"{type(e).__name__}: {e}"
                        if why != self._last_error:  # once per distinct reason, not every probe
                            log.warning("remote tier unavailable", url=self.url, error=why)
                        self._last_error = why
            if up != self._up:
                log.info("remote tier " + ("up" if up else "down"), url=self.url)
            self._up = up
            self._stop.wait(self.health_period_s)

    # ---- write-behind --------------------------------------------------------------------------
    def enqueue(self, key: str, data: Any, **meta: Any) -> bool:
        """Queue an entry for the store; False (counted) when the queue is full or the tier is
        absent. Never blocks."""
        if not self.available:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait((key, data, meta))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            try:
                key, data, meta = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if not self.available:
                self.dropped += 1
                continue
            try:
                rc = self._store.put(key, pack(key, data, **meta))
                if rc == 0:
                    self.written += 1
                else:
                    self.write_errors += 1
            except Exception as e:
                self.write_errors += 1
                log.warning("remote write failed", key=key, error=f"{type(e).__name__}: {e}")

    def flush(self, timeout: float = 10.0) -> bool:
        """Until the queue is drained (tests, shutdown)."""
        end = time.monotonic() + timeout
        while (self._queue.unfinished_tasks and not self._queue.empty()) and time.monotonic() < end:
            time.sleep(0.02)
        return self._queue.empty()

    # ---- reads -------------------------------------------------------------------------------------
    def exists(self, keys: Iterable[str]) -> set[str]:
        keys = list(keys)
        if not keys or not self.available:
            return set()
        try:
            found = self._store.batch_is_exist(keys)
        except Exception as e:
            log.warning("remote is_exist failed", error=f"{type(e).__name__}: {e}")
            return set()
        return {k for k, r in zip(keys, found) if r == 1}

    def get(self, key: str) -> RemoteEntry | None:
        if not self.available:
            return None
        try:
            blob = self._store.get(key)
        except Exception as e:
            log.warning("remote get failed", key=key, error=f"{type(e).__name__}: {e}")
            return None
        entry = unpack(key, blob) if blob else None
        if entry is None:
            if blob:
                self.rejected += 1
                log.warning("remote object rejected (corrupt or foreign)", key=key, size=len(blob))
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def close(self) -> bool:
        """Stop the threads and close the client. False when the master no longer answers: the
        client is then left open (closing it blocks ~6 s, holding the GIL, in Mooncake's
        reconnect attempts, and so does its destructor at exit): end the process with
        os._exit (services/segcache/__main__.py does)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        with self._lock:
            store, self._store = self._store, None
        if store is None:
            return True
        if not self._master_answers():
            log.warning("shared tier's master is gone: leaving its client open", url=self.url)
            self._abandoned = store
            return False
        try:
            store.close()
        except Exception:
            pass
        return True


class RemoteCollector:
    """Prometheus view of the remote tier, read at scrape time."""

    def __init__(self, tier: MooncakeTier):
        self.tier = tier

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        t = self.tier
        yield GaugeMetricFamily("hypic_segcache_remote_up", "The shared tier's master answers (1) or not",
                                value=int(t.available))
        ops = CounterMetricFamily("hypic_segcache_remote_ops", "Shared tier operations by outcome",
                                  labels=["op", "outcome"])
        for op, outcome, n in (("write", "written", t.written), ("write", "dropped", t.dropped),
                               ("write", "error", t.write_errors), ("read", "hit", t.hits),
                               ("read", "miss", t.misses), ("read", "rejected", t.rejected)):
            ops.add_metric([op, outcome], n)
        yield ops
        yield GaugeMetricFamily("hypic_segcache_remote_queue", "Write-behind entries queued for the shared tier",
                                value=t._queue.qsize())
