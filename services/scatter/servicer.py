"""The hypic.v1.Scatter gRPC servicer: build one segment's entry, stream it back, store it.

Single flight: concurrent Builds of one key share one build. The first call creates a flight (a
task that runs the build on the single build thread and then, when any caller asked for it, Puts the
entry into segcache); later calls join it and answer with `shared=true`. The build runs to the end
while anyone waits for it; a queued build whose every caller went away (cancelled, or past its
deadline) is dropped before it starts, even when a store was asked for: a store nobody waits for
is work nobody waits for, and the next request that needs the segment builds it again (requests
abandoned after 0.5 s once left 35,000 tokens of builds running, issue 14). A build already
running is told to stop (its `stop` event, checked by the engine between layers: BuildCancelled)
and ends at the next layer boundary, nothing stored; it counts in Load until it has stopped. A
Build that arrives for a flight told to stop starts a flight of its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
import structlog

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import BuildCancelled
from common.engine.pic.entry import dtype_name
from common.engine.pic.seal import load_secret, seal
from common.mesh.abort import Abort
from common.mesh.checks import WorkerModel, check_build, stream_chunk
from common.mesh.guard import internal_details
from common.mesh.log import sanitize_request_id
from common.mesh.segcache_client import checksum
from common.mesh.segcache_ring import SegcacheRing
from common.mesh.tracing import traced
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from services.scatter import metrics as m
from services.scatter.config import ScatterConfig

log = structlog.get_logger("scatter.servicer")

SERVICE_NAME = "hypic.v1.Scatter"


@dataclass
class Built:
    data: bytes
    build_s: float
    checksum: bytes


@dataclass
class Flight:
    key: str
    token_ids: list[int]
    seam: int
    request_id: str
    store: bool
    result: asyncio.Future  # -> Built
    stored: asyncio.Future  # done once the store phase is over (stored, failed or skipped)
    waiters: int = 0
    started: bool = False  # set on the build thread when the build begins
    stop: threading.Event = field(default_factory=threading.Event)  # every waiter left: stop the build
    created: float = field(default_factory=time.perf_counter)
    task: asyncio.Task | None = None


class ScatterServicer(scatter_grpc.ScatterServicer):
    def __init__(self, cfg: ScatterConfig, engine: HybridEngine, executor: Executor,
                 segcache: SegcacheRing | None, worker: str):
        self.cfg = cfg
        self.engine = engine
        self.executor = executor
        self.segcache = segcache
        self.worker = worker
        self.dtype = dtype_name(engine.dtype)
        self.worker_model = WorkerModel(engine.fingerprint, self.dtype, engine.vocab_size)
        self.secret = load_secret(cfg.entry_key_file)
        self.flights: dict[str, Flight] = {}  # key -> flight, until its store phase is over
        self.pending: dict[str, Flight] = {}  # key -> flight whose build is queued or running

    # ---- validation ---------------------------------------------------------------------
    def _validate(self, req: scatter_pb.BuildRequest) -> list[int]:
        return check_build(req, self.worker_model, max_segment_tokens=self.cfg.max_segment_tokens)

    # ---- the flight ---------------------------------------------------------------------
    def _build(self, fl: Flight) -> Built:
        """On the build thread: prefill the segment alone, serialize its entry."""
        fl.started = True
        m.BUILD_WAIT_SECONDS.observe(time.perf_counter() - fl.created)
        t0 = time.perf_counter()
        entry = self.engine.build_entry(fl.token_ids, fl.seam, should_stop=fl.stop.is_set)
        if entry.key != fl.key:  # what the entry's header will say must be what it is stored under
            raise RuntimeError("built entry's identity differs from its key")
        data = seal(entry.to_bytes(), self.secret)
        build_s = time.perf_counter() - t0
        return Built(data, build_s, checksum(data))

    def _gauges(self) -> None:
        m.IN_FLIGHT.set(len(self.pending))
        m.QUEUED_TOKENS.set(sum(len(f.token_ids) for f in self.pending.values()))

    @traced("scatter.build")
    async def _run(self, fl: Flight) -> None:
        loop = asyncio.get_running_loop()
        try:
            built = await loop.run_in_executor(self.executor, self._build, fl)
        except asyncio.CancelledError:
            m.BUILDS.labels("dropped").inc()
            if not fl.started:
                m.BUILD_WORK.labels("skipped").inc(len(fl.token_ids))
            raise
        except BuildCancelled as e:
            self._cancelled(fl, e)
            return
        except Exception as e:
            m.BUILDS.labels("error").inc()
            log.exception("build failed", key=fl.key, tokens=len(fl.token_ids))
            fl.result.set_exception(Abort(grpc.StatusCode.INTERNAL, "build failed: " + internal_details()))
            return
        self._done_building(fl)
        m.BUILDS.labels("ok").inc()
        m.BUILD_SECONDS.observe(built.build_s)
        m.BUILD_TOKENS.inc(len(fl.token_ids))
        m.BUILD_WORK.labels("done").inc(len(fl.token_ids))
        m.ENTRY_BYTES.inc(len(built.data))
        m.ENTRY_BYTES_BY_FORMAT.labels(self.engine.entry_format).inc(len(built.data))
        fl.result.set_result(built)
        log.info("built", key=fl.key, tokens=len(fl.token_ids), seam=fl.seam, format=self.engine.entry_format,
                 bytes=len(built.data), build_s=round(built.build_s, 6))
        if fl.store:  # decided here, atomically with the result (no await in between)
            await self._store(fl, built)

    def _cancelled(self, fl: Flight, e: BuildCancelled) -> None:
        """A running build stopped between layers: count how far it got; nothing is stored."""
        done = e.tokens * e.layer / e.layers
        m.BUILDS.labels("cancelled").inc()
        m.BUILD_WORK.labels("done").inc(done)
        m.BUILD_WORK.labels("skipped").inc(e.tokens - done)
        log.info("build cancelled", key=fl.key, tokens=e.tokens, layer=e.layer, layers=e.layers,
                 running_s=round(time.perf_counter() - fl.created, 6))
        fl.result.set_exception(Abort(grpc.StatusCode.CANCELLED, "build cancelled"))

    def _done_building(self, fl: Flight) -> None:
        if self.pending.get(fl.key) is fl:
            del self.pending[fl.key]
            self._gauges()

    def _finish(self, fl: Flight, task: asyncio.Task) -> None:
        """Done callback of a flight's task: runs however the task ended (even cancelled
        before it started), so no flight is ever left behind."""
        self._done_building(fl)
        if self.flights.get(fl.key) is fl:
            del self.flights[fl.key]
        if not fl.result.done():
            fl.result.set_exception(Abort(grpc.StatusCode.CANCELLED, "build dropped"))
        if not fl.stored.done():
            fl.stored.set_result(False)
        for f in (fl.result, task):  # mark exceptions retrieved: waiters may all be gone
            if f.done() and not f.cancelled():
                f.exception()

    async def _store(self, fl: Flight, built: Built) -> None:
        """Best effort: a segcache failure is logged, never fails the build."""
        if self.segcache is None:
            m.STORES.labels("no_segcache").inc()
            log.debug("store asked but no segcache configured", key=fl.key)
            return
        try:
            resp = await self.segcache.put(
                fl.key, built.data, recompute_cost_s=built.build_s, token_count=len(fl.token_ids),
                model_fingerprint=self.engine.fingerprint, request_id=fl.request_id or None,
                timeout=self.cfg.segcache_timeout_s)
            m.STORES.labels("created" if resp.created else "exists").inc()
            log.info("stored", key=fl.key, created=resp.created)
        except Exception as e:  # grpc errors, timeouts: the build itself succeeded
            m.STORES.labels("error").inc()
            log.warning("store failed", key=fl.key, error=f"{type(e).__name__}: {e}")

    def _join(self, key: str, ids: list[int], seam: int, request_id: str, store: bool) -> tuple[Flight, bool]:
        fl = self.flights.get(key)
        if fl is not None and not fl.stop.is_set():
            fl.store = fl.store or store
            m.SHARED.inc()
            return fl, True
        loop = asyncio.get_running_loop()
        fl = Flight(key=key, token_ids=ids, seam=seam, request_id=request_id, store=store,
                    result=loop.create_future(), stored=loop.create_future())
        self.flights[key] = fl  # replaces a flight told to stop (its cleanup checks identity)
        self.pending[key] = fl
        self._gauges()
        fl.task = asyncio.create_task(self._run(fl), name=f"build-{key[:12]}")
        fl.task.add_done_callback(lambda t, fl=fl: self._finish(fl, t))
        return fl, False

    def _leave(self, fl: Flight) -> None:
        fl.waiters -= 1
        if fl.waiters > 0 or fl.result.done():
            return
        # Nobody waits for it any more. Running: the engine stops at its next layer. Queued:
        # dropped now (the event also covers a build the thread has just picked up).
        fl.stop.set()
        if not fl.started and fl.task is not None:
            fl.task.cancel()

    # ---- RPCs -----------------------------------------------------------------------------
    async def Build(self, request: scatter_pb.BuildRequest, context):
        try:
            ids = self._validate(request)
        except Abort as e:
            await e.send(context)
        rid = sanitize_request_id(request.request_id) or (structlog.contextvars.get_contextvars().get("request_id") or "")
        fl, shared = self._join(request.key, ids, int(request.seam), rid, request.store)
        fl.waiters += 1
        try:
            try:
                built: Built = await asyncio.shield(fl.result)
            except Abort as e:
                await e.send(context)
            chunk = stream_chunk(request.chunk_bytes, self.cfg.chunk_bytes, self.cfg.max_message_bytes)
            data = memoryview(built.data)
            header = scatter_pb.BuildHeader(key=fl.key, size=len(data), build_s=built.build_s,
                                    shared=shared, worker=self.worker, checksum=built.checksum)
            yield scatter_pb.BuildResponse(header=header, data=bytes(data[:chunk]))
            for off in range(chunk, len(data), chunk):
                yield scatter_pb.BuildResponse(data=bytes(data[off:off + chunk]))
            if request.store:
                # End the stream once the entry is in segcache (or the store failed), so that a
                # caller who saw the stream end can rely on the next lookup.
                await asyncio.shield(fl.stored)
        finally:
            self._leave(fl)

    async def Load(self, request: scatter_pb.LoadRequest, context) -> scatter_pb.LoadResponse:
        return scatter_pb.LoadResponse(
            in_flight=len(self.pending),
            queued_tokens=float(sum(len(f.token_ids) for f in self.pending.values())),
            worker=self.worker, model_fingerprint=self.engine.fingerprint, entry_format=self.engine.entry_format)
