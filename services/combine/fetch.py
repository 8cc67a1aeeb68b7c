"""Getting one segment's entry: from segcache, from a scatter worker, or built here.

`acquire()` is one asyncio task per segment; every segment of a plan starts at once. It never
fails for a reason another source could cure:

    SOURCE_SEGCACHE -> segcache (a CUDA IPC handle when the entry is in segcache's GPU memory and that
                       is this combine's GPU: device_fetch.py; else a NIXL read when both ends have
                       it, else the gRPC stream)
                       -> on a miss / error / bad entry: the scatter chain below
    SOURCE_SCATTER  -> plan.scatter_addresses[worker], then the next addresses in turn
                       -> on an error / bad entry everywhere: built on this worker
    SOURCE_LOCAL    -> built on this worker

Formats (--entry-format, common/engine/pic/compact.py): an fp32 entry is rounded to this
combine's compact format where it arrives (what a builder of that format writes); a compact entry
of another format is never composed: it is dropped from segcache and the segment is built here,
not on the scatter workers (a mesh's workers share one format: they would all build it again),
so that the next request finds this combine's entry in segcache instead of rebuilding again.

Every remote call carries the request id (x-request-id) and the time left of the Execute
deadline; when no time is left the task raises DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc
import structlog

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import BuildCancelled
from common.engine.pic.entry import EntryMismatch, SegmentEntry
from common.engine.pic.placement import place_for_engine
from common.engine.pic.seal import ForgedEntry, open_sealed, seal
from common.mesh import tracing
from common.mesh.log import REQUEST_ID_KEY
from common.mesh.nixl_util import NixlUnavailable
from common.mesh.segcache_client import ChecksumError, SegcacheClient
from common.mesh.segcache_ring import owner, parse_addresses
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.combine import metrics as m
from services.combine.config import CombineConfig
from services.combine.device_fetch import fetch_at_place, reader_place
from services.combine.peers import Peers, PeerUnavailable, ensure_connected

log = structlog.get_logger("combine.fetch")

TIER_NAMES = {segcache_pb.TIER_DEVICE: "device", segcache_pb.TIER_HOST: "host", segcache_pb.TIER_DISK: "disk",
              segcache_pb.TIER_REMOTE: "remote"}


class DeadlineExceeded(Exception):
    """The Execute deadline passed."""


class BadEntry(Exception):
    """Bytes that arrived are not a usable entry for this plan (short, corrupt, mismatched)."""

    def __init__(self, reason: str, details: str):
        super().__init__(details)
        self.reason = reason


class Deadline:
    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def left(self, cap: float | None = None) -> float:
        """Seconds left (at most `cap`); raises DeadlineExceeded when none are."""
        r = self.remaining()
        if r <= 0:
            raise DeadlineExceeded("deadline exceeded")
        return r if cap is None else min(r, cap)


@dataclass
class Acquired:
    """One segment's entry and where it really came from."""

    index: int
    entry: SegmentEntry
    source: int  # combine_pb2.SegmentSource
    fetch_s: float  # from the start of the fetch to the entry in hand (build wait for misses)
    arrived: float  # perf_counter() when it was in hand
    build_s: float = 0.0
    tier: str = ""
    worker: str = ""
    via_nixl: bool = False
    nbytes: int = 0


@dataclass
class RequestCtx:
    """What a request's segment tasks share."""

    cfg: CombineConfig
    peers: Peers
    engine: HybridEngine
    run: Callable[..., Awaitable[Any]]  # runs a function on the engine thread
    request_id: str
    deadline: Deadline
    seam: int  # the seam width entries must have (common.engine.modes.seam_for)
    dtype: str
    scatter_addresses: list[str]
    segcache_address: str | None  # one instance or a comma-separated list (the router's view)
    store: bool
    segcache_keys: list[str]  # keys planned as hits (for one tier Lookup on the NIXL path)
    secret: bytes = b""  # the mesh's entry secret (common/engine/pic/seal.py)
    background: list[asyncio.Task] = field(default_factory=list)  # drains and stores
    _lookup: dict[str, asyncio.Task] = field(default_factory=dict)  # instance -> its Lookup

    def segcache_for(self, key: str) -> str:
        """The instance holding `key`: rendezvous over the plan's list, the router's placement."""
        return owner(key, parse_addresses(self.segcache_address))

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [(REQUEST_ID_KEY, self.request_id)]

    def spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.background.append(t)

    def lookup(self, addr: str, client: SegcacheClient) -> asyncio.Task:
        """One batched Lookup per request and instance of the keys planned as hits there: tier
        and size of each, which choose between a NIXL read and the gRPC stream (the NIXL client
        reports no tier)."""
        if addr not in self._lookup:
            keys = [k for k in self.segcache_keys if self.segcache_for(k) == addr][:4096]
            t = asyncio.create_task(client.lookup(
                keys, request_id=self.request_id, timeout=self.deadline.left(self.cfg.segcache_timeout_s)))
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
            self.background.append(t)
            self._lookup[addr] = t
        return self._lookup[addr]


def check_entry(entry: SegmentEntry, ctx: RequestCtx, ids: list[int]) -> None:
    """The entry must be exactly what the plan asks for (SegmentEntry.check, through the engine,
    which knows its layer layout); otherwise it is rebuilt."""
    try:
        ctx.engine.check_entry(entry, ids, ctx.seam)
    except EntryMismatch as e:
        raise BadEntry("mismatch", str(e)) from None


def check_device_entry(entry: SegmentEntry, ctx: RequestCtx, ids: list[int]) -> None:
    """check_entry for an entry read by CUDA IPC, which is composed as it is: one in another format
    than this combine's fails here, and the host path that follows applies in_expected_format."""
    if entry.format != ctx.engine.entry_format:
        raise BadEntry("format", f"entry stored in {entry.format}, this combine composes {ctx.engine.entry_format}")
    check_entry(entry, ctx, ids)


def in_expected_format(entry: SegmentEntry, expected: str) -> SegmentEntry:
    """The entry in the format this combine composes with (its --entry-format). An fp32 entry is
    rounded to a compact one here: exactly the entry a builder of that format writes (it rounds
    its fp32 build the same way, SegmentEntry.with_format). A compact entry is never widened into
    another format (its lost bits would pass for exact ones): BadEntry "format", then a rebuild."""
    if entry.format == expected:
        return entry
    if entry.format != "fp32":
        raise BadEntry("format", f"entry stored in {entry.format}, this combine composes {expected} entries "
                       "(--entry-format: every worker of a mesh the same)")
    m.FORMAT_CONVERTED.labels(entry.format, expected).inc()
    return entry.with_format(expected)


def _open_and_parse(sealed, key: str, secret: bytes) -> SegmentEntry:
    """One check per byte, where it lands: the seal (its tag covers every byte); the entry's tensors
    are then views of the received buffer (a fresh one per read), not copies."""
    try:
        inner = open_sealed(sealed, key, secret)
    except ForgedEntry as e:
        raise BadEntry("forged", str(e)) from None
    try:
        return SegmentEntry.from_bytes(inner, sealed=True)
    except Exception as e:  # EntryError (magic, version, checksum) or any malformed byte
        raise BadEntry("corrupt", f"{type(e).__name__}: {e}") from None


async def parse_entry(data, ctx: RequestCtx, key: str, ids: list[int]) -> SegmentEntry:
    """The entry in sealed bytes that arrived for segment `key`: its seal opens under the mesh's
    secret, its header names `key`, and it fits the plan; BadEntry otherwise. Returned placed on the
    engine's device (T, S fp32; the rest in the model's dtype: common.engine.pic.placement)."""
    entry = await asyncio.to_thread(_open_and_parse, data, key, ctx.secret)
    if entry.format != ctx.engine.entry_format:
        entry = await asyncio.to_thread(in_expected_format, entry, ctx.engine.entry_format)
    check_entry(entry, ctx, ids)
    return await asyncio.to_thread(place_for_engine, entry, ctx.engine)


# Reasons an entry from segcache is dropped there: it would fail everyone who reads it ("format":
# every combine of a mesh composes one format; the one that reads it rebuilds and stores its own).
DROP_REASONS = ("forged", "corrupt", "mismatch", "format")


class WrongFormat:
    """What a fetch returns when the entry it got is in a format this combine cannot compose:
    built by a scatter of another --entry-format. The segment is then built here, not on the
    next scatter worker (the mesh's workers share one format: they would all build it again)."""


WRONG_FORMAT = WrongFormat()


async def drop_from_segcache(ctx: RequestCtx, client: SegcacheClient, key: str, reason: str) -> None:
    """Delete a rejected entry from segcache, before the segment is rebuilt (whose store then
    finds the key free): a bad entry never blocks its key. Best effort, briefly."""
    m.DROPPED.labels(reason).inc()
    try:
        await client.delete([key], request_id=ctx.request_id, timeout=ctx.deadline.left(1.0))
        log.warning("rejected entry dropped from segcache", key=key, reason=reason)
    except DeadlineExceeded:
        raise
    except Exception as e:
        log.warning("could not drop a rejected entry from segcache", key=key, reason=reason,
                    error=_describe(e))


def _reason(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name.lower()
    if isinstance(e, BadEntry):
        return e.reason
    if isinstance(e, ChecksumError):
        return "checksum"
    if isinstance(e, PeerUnavailable):
        return "unavailable"
    if isinstance(e, asyncio.TimeoutError):
        return "timeout"
    return "error"


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


# ---- segcache --------------------------------------------------------------------------------
WAIT_FIRST_POLL_S = 0.02
WAIT_MAX_POLL_S = 0.25


async def wait_for_entry(ctx: RequestCtx, key: str, wait_s: float) -> segcache_pb.EntryInfo | None:
    """Another request holds the build claim on `key`: poll its instance until the entry is
    cached (its EntryInfo) or `wait_s` passes (None: build it here). Faults end the wait."""
    end = time.monotonic() + wait_s
    _, client = ctx.peers.segcache(ctx.segcache_for(key))
    poll = WAIT_FIRST_POLL_S
    while True:
        try:
            infos = await client.lookup([key], request_id=ctx.request_id,
                                        timeout=ctx.deadline.left(ctx.cfg.segcache_timeout_s))
        except (asyncio.CancelledError, DeadlineExceeded):
            raise
        except Exception as e:
            log.info("wait for a segment built elsewhere failed", key=key, error=_describe(e))
            return None
        if infos and infos[0].tier != segcache_pb.TIER_MISS:
            return infos[0]
        left = min(end - time.monotonic(), ctx.deadline.left())
        if left <= 0:
            m.FALLBACKS.labels("segcache", "wait_timeout").inc()
            log.info("segment built elsewhere did not arrive in time; building", key=key,
                     wait_s=round(wait_s, 3))
            return None
        await asyncio.sleep(min(poll, left))
        poll = min(poll * 2, WAIT_MAX_POLL_S)


async def fetch_segcache(ctx: RequestCtx, i: int, key: str, ids: list[int],
                         info_now: segcache_pb.EntryInfo | None = None) -> Acquired | WrongFormat | None:
    """The entry from segcache, or None (miss or failure: logged, counted, rebuilt elsewhere;
    WRONG_FORMAT when the failure is the entry's format).
    info_now: a Lookup answer newer than the request's batched one (after a wait)."""
    assert ctx.segcache_address
    addr = ctx.segcache_for(key)
    t0 = time.perf_counter()
    channel, client = ctx.peers.segcache(addr)
    try:
        timeout = ctx.deadline.left(ctx.cfg.segcache_timeout_s)
        await ensure_connected(channel, min(timeout, ctx.cfg.connect_timeout_s))
        data, tier, via_nixl, entry, ipc_bytes = None, "", False, None, 0
        place = reader_place(ctx.engine.device, sealed=bool(ctx.secret))  # None off CUDA
        info = None
        if ctx.peers.nixl_ready(addr) or place is not None:
            try:
                info = info_now or next(
                    (x for x in await asyncio.shield(ctx.lookup(addr, client)) if x.key == key), None)
            except (asyncio.CancelledError, DeadlineExceeded):
                raise
            except Exception:  # no sizes: read over gRPC
                info = None
            if info is not None and info.tier == segcache_pb.TIER_MISS:
                raise BadEntry("miss", "not cached")
        if place is not None and (info is None or info.tier == segcache_pb.TIER_DEVICE):
            # in segcache's GPU memory: a CUDA IPC handle when it is our GPU (device_fetch.py)
            hit = await fetch_at_place(client, key, place, ctx.engine, lambda e: check_device_entry(e, ctx, ids),
                                       request_id=ctx.request_id, spawn=ctx.spawn,
                                       timeout=ctx.deadline.left(ctx.cfg.segcache_timeout_s))
            if hit is None:
                raise BadEntry("miss", "not cached")
            entry, data, tier = hit.entry, hit.data, TIER_NAMES.get(hit.info.tier, "")
            ipc_bytes = hit.info.size
        if entry is None and data is None and ctx.peers.nixl_ready(addr):
            if info is not None and info.size >= ctx.cfg.nixl_min_bytes:
                tier = TIER_NAMES.get(info.tier, "")
                try:
                    arr = await client.get_via_nixl(key, verify=False, request_id=ctx.request_id,
                                                    timeout=ctx.deadline.left(ctx.cfg.segcache_timeout_s))
                    if arr is None:
                        raise BadEntry("miss", "not cached")
                    data, via_nixl = arr, True
                except NixlUnavailable as e:
                    ctx.peers.nixl_broken(addr, str(e))
                except (BadEntry, DeadlineExceeded, asyncio.CancelledError):
                    raise
                except Exception as e:  # a failed NIXL transfer: try the gRPC stream once
                    m.FALLBACKS.labels("nixl", _reason(e)).inc()
                    log.warning("nixl read failed, trying gRPC", index=i, key=key, error=_describe(e))
        if entry is None and data is None:
            got = await client.get_with_info(key, verify=False, request_id=ctx.request_id,
                                             timeout=ctx.deadline.left(ctx.cfg.segcache_timeout_s))
            if got is None:
                raise BadEntry("miss", "not cached")
            info, buf = got
            data, tier = buf, TIER_NAMES.get(info.tier, "")
        if entry is None:
            entry = await parse_entry(data, ctx, key, ids)
    except (asyncio.CancelledError, DeadlineExceeded):
        raise
    except Exception as e:
        reason = _reason(e)
        if reason in DROP_REASONS:
            await drop_from_segcache(ctx, client, key, reason)
        m.FALLBACKS.labels("segcache", reason).inc()
        (log.info if reason == "miss" else log.warning)(
            "segcache fetch failed, rebuilding", index=i, key=key, segcache=addr, reason=reason,
            error=_describe(e))
        ctx.deadline.left()
        return WRONG_FORMAT if reason == "format" else None
    fetch_s = time.perf_counter() - t0
    m.STAGE_SECONDS.labels("fetch").observe(fetch_s)
    return Acquired(i, entry, combine_pb.SOURCE_SEGCACHE, fetch_s, time.perf_counter(), tier=tier,
                    worker=addr, via_nixl=via_nixl, nbytes=len(data) if data is not None else ipc_bytes)


# ---- scatter -----------------------------------------------------------------------------------
async def _drain(call: Any) -> None:
    """Read a Build stream to its end: scatter ends it once its segcache Put is done."""
    try:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    except Exception as e:  # the entry is already in hand; only the store may be lost
        log.debug("build stream ended badly after the entry arrived", error=_describe(e))


async def build_on_scatter(ctx: RequestCtx, i: int, addr: str, key: str, ids: list[int],
                           t0: float) -> Acquired | WrongFormat | None:
    """The entry built by the scatter worker at `addr`, or None (failure: logged, counted;
    WRONG_FORMAT when the failure is the entry's format)."""
    channel, stub = ctx.peers.scatter(addr)
    call = None
    try:
        await ensure_connected(channel, ctx.deadline.left(ctx.cfg.connect_timeout_s))
        req = scatter_pb.BuildRequest(key=key, token_ids=ids, seam=ctx.seam,
                               model_fingerprint=ctx.engine.fingerprint, dtype=ctx.dtype,
                               request_id=ctx.request_id, store=ctx.store)
        call = stub.Build(req, timeout=ctx.deadline.left(), metadata=ctx.metadata)
        header, buf, n = None, bytearray(), 0
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                break
            if header is None:
                if not msg.HasField("header"):
                    raise BadEntry("protocol", "the first Build message carries no header")
                header = msg.header
                buf = bytearray(header.size)
            d = msg.data
            if n + len(d) > len(buf):
                raise BadEntry("protocol", f"more than the announced {len(buf)} bytes")
            buf[n:n + len(d)] = d
            n += len(d)
            if n == len(buf):
                break  # everything is here: compose now, let the stream end in the background
        if header is None or n != header.size:
            raise BadEntry("short", f"stream ended after {n} of {header.size if header else '?'} bytes")
        entry = await parse_entry(buf, ctx, key, ids)  # verified there, header.checksum not needed
    except (asyncio.CancelledError, DeadlineExceeded):
        if call is not None:
            call.cancel()
        raise
    except Exception as e:
        if call is not None:
            call.cancel()
        m.FALLBACKS.labels("scatter", _reason(e)).inc()
        log.warning("scatter build failed, trying elsewhere", index=i, key=key, scatter=addr,
                    reason=_reason(e), error=_describe(e))
        ctx.deadline.left()
        return WRONG_FORMAT if _reason(e) == "format" else None
    ctx.spawn(_drain(call))
    fetch_s = time.perf_counter() - t0
    m.STAGE_SECONDS.labels("build").observe(fetch_s)
    return Acquired(i, entry, combine_pb.SOURCE_SCATTER, fetch_s, time.perf_counter(),
                    build_s=header.build_s, worker=header.worker or addr, nbytes=n)


# ---- local -------------------------------------------------------------------------------------
def _timed_build(engine, ids: list[int], seam: int, should_stop: Callable[[], bool]) -> tuple[SegmentEntry, float]:
    t = time.perf_counter()
    try:
        entry = engine.build_entry(ids, seam, should_stop=should_stop)
    except BuildCancelled as e:  # on the engine thread, after its request went away
        log.info("local build stopped", tokens=e.tokens, layer=e.layer, layers=e.layers)
        raise
    return entry, time.perf_counter() - t


async def _store(ctx: RequestCtx, key: str, entry: SegmentEntry, build_s: float) -> None:
    try:
        data = await asyncio.to_thread(lambda: seal(entry.to_bytes(), ctx.secret))
        _, client = ctx.peers.segcache(ctx.segcache_for(key))
        await client.put(key, data, recompute_cost_s=build_s, token_count=entry.n_tokens,
                         model_fingerprint=entry.model_fingerprint, request_id=ctx.request_id,
                         timeout=ctx.deadline.left(ctx.cfg.segcache_timeout_s))
    except Exception as e:  # best effort
        log.warning("store of a local build failed", key=key, error=_describe(e))


async def build_local(ctx: RequestCtx, i: int, key: str, ids: list[int], t0: float) -> Acquired:
    ctx.deadline.left()
    stop = threading.Event()  # the request went away: the build ends at its next layer (BuildCancelled)
    try:
        entry, build_s = await ctx.run(_timed_build, ctx.engine, ids, ctx.seam, stop.is_set)
    except asyncio.CancelledError:
        stop.set()
        log.info("local build cancelled", index=i, key=key, tokens=len(ids))
        raise
    if ctx.store and ctx.segcache_address and ctx.cfg.store_local_builds:
        ctx.spawn(_store(ctx, key, entry, build_s))
    fetch_s = time.perf_counter() - t0
    m.STAGE_SECONDS.labels("build").observe(fetch_s)
    return Acquired(i, entry, combine_pb.SOURCE_LOCAL, fetch_s, time.perf_counter(), build_s=build_s,
                    worker="local")


# ---- one segment ---------------------------------------------------------------------------------
async def acquire(ctx: RequestCtx, i: int, seg: Any, key: str, ids: list[int]) -> Acquired:
    """Segment i's entry: from segcache, else built on scatter, else here; one trace span each."""
    with tracing.span("combine.fetch", segment=i, key=key, planned_source=int(seg.source)):
        return await _acquire(ctx, i, seg, key, ids)


async def _acquire(ctx: RequestCtx, i: int, seg: Any, key: str, ids: list[int]) -> Acquired:
    t0 = time.perf_counter()
    got = None
    if seg.source == combine_pb.SOURCE_SEGCACHE and ctx.segcache_address:
        info_now = None
        if seg.wait_s > 0:  # being built by another request (a build claim): wait for it
            info_now = await wait_for_entry(ctx, key, seg.wait_s)
        if seg.wait_s <= 0 or info_now is not None:
            got = await fetch_segcache(ctx, i, key, ids, info_now)
            if isinstance(got, Acquired):
                return got
    addrs = ctx.scatter_addresses
    if seg.source != combine_pb.SOURCE_LOCAL and addrs and got is not WRONG_FORMAT:
        first = seg.worker if seg.worker < len(addrs) else i % len(addrs)
        for k in range(len(addrs)):
            got = await build_on_scatter(ctx, i, addrs[(first + k) % len(addrs)], key, ids, t0)
            if isinstance(got, Acquired):
                return got
            if got is WRONG_FORMAT:
                break
    return await build_local(ctx, i, key, ids, t0)
