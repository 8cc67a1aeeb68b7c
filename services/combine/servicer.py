"""The hypic.v1.Combine gRPC servicer: run a plan, stream segment, token and timing events.

The request lifecycle is written out step by step in docs/combine.md. Model compute (entry
builds, composition, the query chunk, each decode step) runs on one engine thread — a
single-worker executor, so requests never run the model at once and a cancelled request cannot
release the model while its computation is still running — and the event loop stays free for
transfers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import structlog
import torch

from common.engine import modes
from common.engine.hybrid_engine import HybridEngine, pick_token  # the sampler engine.generate uses
from common.engine.pic import compose_run, compose_segment, prefill_segments
from common.engine.pic.entry import dtype_name
from common.engine.pic.reuse import compose_and_query, without_arenas
from common.engine.pic.runs import arrived_run
from common.engine.pic.seal import load_secret
from common.mesh.abort import Abort
from common.mesh.checks import WorkerModel, check_plan
from common.mesh.guard import internal_details
from common.mesh.log import new_request_id, sanitize_request_id
from common.mesh.tracing import traced
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from protos.hypic.v1 import router_pb2 as router_pb
from services.combine import metrics as m
from services.combine.config import CombineConfig
from services.combine.fetch import Acquired, Deadline, DeadlineExceeded, RequestCtx, acquire
from services.combine.peers import Peers
from services.combine.segcache_members import SegcacheMembers, planned_segcache
from services.combine.shadow import ShadowRPC

log = structlog.get_logger("combine.servicer")

SERVICE_NAME = "hypic.v1.Combine"
SOURCES = {combine_pb.SOURCE_SEGCACHE: "segcache", combine_pb.SOURCE_SCATTER: "scatter", combine_pb.SOURCE_LOCAL: "local"}


def _mode_label(value: int) -> str:
    """The metrics label of a plan's mode, even when it is not a mode."""
    try:
        return modes.from_wire(value)
    except ValueError:
        return "unknown"


@dataclass
class _Execution:
    """One Execute call, as its stages share it."""
    plan: combine_pb.Plan
    mode: str  # canonical (common.engine.modes)
    segs: list[list[int]]
    keys: list[str]
    query: list[int]
    ctx: RequestCtx
    t_start: float
    timings: router_pb.Timings
    order: str | None  # compose order (_compose_order); None: the mode recomputes instead
    lead: int  # segments composed in the leading layer-major pass
    tasks: list[asyncio.Task] = field(default_factory=list)  # one fetch per segment
    runs: list[int] = field(default_factory=list)  # segments per composition pass, in prompt order


@dataclass
class _Composed:
    """What composition ends with: the prompt state and, when the query was folded into the last
    layer-major pass (compose_and_query), the query's logits and the state after it."""
    state: Any
    logits: torch.Tensor | None = None


class _SeamTimer:
    """Stands in for the engine inside compose_segment and times its forward calls, which are
    exactly the seam recompute; everything else is passed through untouched."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.seconds = 0.0

    def forward(self, *args: Any, **kw: Any):
        t = time.perf_counter()
        try:
            return self._engine.forward(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _timed_call(call: Callable, mode: str, phase: str, submitted: float) -> Any:
    """Engine thread: call(), observed as metrics.ENGINE_SECONDS{mode, phase} (its own time) and
    ENGINE_WAIT_SECONDS{mode} (from its submission to its start: the queue)."""
    start = time.perf_counter()
    try:
        return call()
    finally:
        m.ENGINE_WAIT_SECONDS.labels(mode).observe(start - submitted)
        m.ENGINE_SECONDS.labels(mode, phase).observe(time.perf_counter() - start)


def eos_token_ids(engine: Any, model_dir: Path) -> set[int]:
    found: set[int] = set()
    sources = [getattr(engine.config, "eos_token_id", None)]
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    if engine.tokenizer is not None:
        sources.append(engine.tokenizer.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            found.add(s)
        elif isinstance(s, (list, tuple)):
            found.update(int(t) for t in s if isinstance(t, int))
    return found


class CombineServicer(ShadowRPC, combine_grpc.CombineServicer):  # + Shadow (services/combine/shadow.py)
    def __init__(self, cfg: CombineConfig, engine: HybridEngine):
        self.cfg = cfg
        self.engine = engine
        self.dtype = dtype_name(engine.dtype)
        self.worker_model = WorkerModel(engine.fingerprint, self.dtype, engine.vocab_size)
        self.secret = load_secret(cfg.entry_key_file)
        self.eos = eos_token_ids(engine, cfg.model)  # type: ignore[arg-type]
        self.peers = Peers(cfg)
        self.segcache_members = SegcacheMembers(cfg.segcache_address)
        self.engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="combine-engine")
        self.in_flight = 0

    async def run(self, fn: Callable, *args: Any, mode: str = "", phase: str = "") -> Any:
        """Run fn(*args) on the engine thread (one at a time, in arrival order). Given a phase,
        the call's own time and its wait for the thread are observed apart (_timed_call)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args)
        if phase:
            call = functools.partial(_timed_call, call, mode, phase, time.perf_counter())
        return await loop.run_in_executor(self.engine_thread, call)

    async def close(self) -> None:
        await self.peers.close()
        self.engine_thread.shutdown(wait=True, cancel_futures=True)

    # ---- validation ---------------------------------------------------------------------
    def _start(self, plan: combine_pb.Plan, rid: str, t_start: float, context,
               segcache_known: list[str] | None = None) -> _Execution:
        """A validated plan, ready to run (Abort when it is not valid)."""
        checked = check_plan(plan, self.worker_model, max_new_tokens=self.cfg.max_new_tokens,
                             max_prompt_tokens=self.cfg.max_prompt_tokens)
        mode, segs, keys, query = checked.mode, checked.segments, checked.keys, checked.query
        remaining = context.time_remaining()
        ctx = RequestCtx(
            cfg=self.cfg, peers=self.peers, engine=self.engine, run=self.run, request_id=rid,
            deadline=Deadline(remaining if remaining is not None else self.cfg.default_timeout_s),
            seam=checked.seam, dtype=self.dtype,
            scatter_addresses=list(plan.scatter_addresses),
            segcache_address=planned_segcache(plan.segcache_address, self.cfg.segcache_address,
                                              segcache_known),
            store=plan.store_entries,
            segcache_keys=[k for s, k in zip(plan.segments, keys) if s.source == combine_pb.SOURCE_SEGCACHE],
            secret=self.secret)
        timings = router_pb.Timings(segments=len(segs), prompt_tokens=sum(len(s) for s in segs) + len(query))
        order, lead = self._compose_order(mode, plan)
        return _Execution(plan=plan, mode=mode, segs=segs, keys=keys, query=query, ctx=ctx,
                          t_start=t_start, timings=timings, order=order, lead=lead)

    # ---- RPCs -----------------------------------------------------------------------------
    async def Info(self, request: combine_pb.CombineInfoRequest, context) -> combine_pb.CombineInfoResponse:
        return combine_pb.CombineInfoResponse(model_type=self.engine.model_type,
                                      model_fingerprint=self.engine.fingerprint,
                                      dtype=self.dtype, in_flight=self.in_flight,
                                      entry_format=self.engine.entry_format)

    async def Execute(self, plan: combine_pb.Plan, context):
        """Run a plan (docs/combine.md): its events, or a status. The stages are in _run."""
        t_start = time.perf_counter()
        rid = sanitize_request_id(plan.request_id) or structlog.contextvars.get_contextvars().get("request_id") or new_request_id()
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            known = await self.segcache_members.known(plan.segcache_address)
            ex = self._start(plan, rid, t_start, context, known)
        except Abort as e:
            m.REQUESTS.labels(_mode_label(plan.mode), "rejected").inc()
            log.info("plan rejected", code=e.code.name, details=e.details)
            await e.send(context)
        self.in_flight += 1
        m.IN_FLIGHT.inc()
        outcome = "error"
        try:
            async for event in self._run(ex):
                yield event
            outcome = "ok"
        except DeadlineExceeded:
            outcome = "deadline"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except asyncio.CancelledError:
            outcome = "cancelled"
            log.info("cancelled by the caller")
            raise
        except GeneratorExit:
            outcome = "cancelled"
            raise
        except Abort as e:
            await e.send(context)
        except Exception as e:  # a bug or a model error: say so, keep serving
            log.exception("execute failed", error=f"{type(e).__name__}: {e}")
            await context.abort(grpc.StatusCode.INTERNAL, internal_details())
        finally:
            for t in [*ex.tasks, *ex.ctx.background]:
                if not t.done():
                    t.cancel()
            self.in_flight -= 1
            m.IN_FLIGHT.dec()
            m.REQUESTS.labels(ex.mode, outcome).inc()

    # ---- stages -----------------------------------------------------------------------------
    async def _run(self, ex: _Execution):
        """The prompt state (composed from entries, or recomputed for the baselines), the
        decode, then the background work; yields the plan's events, timings last."""
        if ex.order is not None:
            composed = None
            async for ev in self._compose(ex):
                if isinstance(ev, combine_pb.SegmentReady):
                    yield combine_pb.CombineEvent(segment=ev)
                else:
                    composed = ev
            ex.ctx.deadline.left()
            if composed.logits is None:
                t = time.perf_counter()
                logits, state = await self.run(self._query, ex.query, composed.state, mode=ex.mode,
                                               phase="query")
                self._query_timed(ex, t)
            else:  # folded into the last pass: its time is in compose_s, query_prefill_s stays 0
                logits, state = composed.logits, composed.state
        else:
            t = time.perf_counter()
            logits, state, ex.timings.recomputed = await self.run(self._baseline, ex.mode, ex.segs, ex.query,
                                                                       mode=ex.mode, phase="prefill")
            self._query_timed(ex, t)
            # What was recomputed is known now: the router reports it with the first token.
            yield combine_pb.CombineEvent(timings=ex.timings)
        async for ev in self._decode(ex, logits, state):
            yield ev
        await self._settle(ex)
        yield combine_pb.CombineEvent(timings=ex.timings)

    @staticmethod
    def _query_timed(ex: _Execution, t: float) -> None:
        ex.timings.query_prefill_s = time.perf_counter() - t
        m.STAGE_SECONDS.labels("query_prefill").observe(ex.timings.query_prefill_s)

    @traced("combine.decode")
    async def _decode(self, ex: _Execution, logits: torch.Tensor, state):
        """The first token from the prompt's logits, then one step per token; yields them."""
        plan = ex.plan
        gen = torch.Generator().manual_seed(int(plan.seed)) if plan.temperature > 0 else None
        top_k = min(int(plan.top_k), self.engine.vocab_size)
        pick = functools.partial(pick_token, temperature=float(plan.temperature), top_k=top_k, gen=gen,
                                 top_p=float(plan.top_p))
        tok = pick(logits)
        # a shadowed plan: the query's logits and every step's greedy pick, for the router's shadow
        first = router_pb.TokenEvent(token_id=tok, index=0, argmax_id=int(logits.argmax()) if plan.shadow else 0)
        if plan.return_logits or plan.shadow:
            first.logits.extend(logits.float().tolist())
        ex.timings.ttft_s = time.perf_counter() - ex.t_start
        m.STAGE_SECONDS.labels("ttft").observe(ex.timings.ttft_s)
        yield combine_pb.CombineEvent(token=first)
        m.TOKENS.inc()
        for index in range(1, plan.max_tokens):
            if plan.stop_at_eos and tok in self.eos:
                break
            ex.ctx.deadline.left()
            t = time.perf_counter()
            tok, greedy, state = await self.run(self._step, tok, state, pick, plan.shadow, mode=ex.mode,
                                             phase="decode_token")
            m.STAGE_SECONDS.labels("decode_token").observe(time.perf_counter() - t)
            yield combine_pb.CombineEvent(token=router_pb.TokenEvent(
                token_id=tok, index=index, argmax_id=greedy))
            m.TOKENS.inc()

    async def _settle(self, ex: _Execution) -> None:
        """Let scatter streams end (their segcache Puts) and local stores finish, then log."""
        ctx, timings = ex.ctx, ex.timings
        if ctx.background:
            wait_s = min(self.cfg.background_wait_s, max(0.0, ctx.deadline.remaining()))
            await asyncio.wait(ctx.background, timeout=wait_s)
        timings.total_s = time.perf_counter() - ex.t_start
        m.STAGE_SECONDS.labels("total").observe(timings.total_s)
        log.info("executed", mode=ex.mode, compose_order=ex.order, compose_runs=ex.runs, segments=timings.segments,
                 hits=timings.hits, misses=timings.misses, prompt_tokens=timings.prompt_tokens,
                 ttft_s=round(timings.ttft_s, 6), total_s=round(timings.total_s, 6))

    def _compose_order(self, mode: str, plan: combine_pb.Plan) -> tuple[str | None, int]:
        """(order, lead): the first `lead` segments are composed in one layer-major pass, the
        rest segment by segment. order is "layer" (lead = all), "mixed" (a leading run of hits,
        then segment-major), "segment" (lead = 0), or None when the mode recomputes instead."""
        if not modes.uses_entries(mode):
            return None, 0
        # Layer-major is faster (all seams go through each layer together) but can only start
        # once its last entry is in. Segcache hits arrive together, so nothing is lost waiting
        # for the plan's leading run of hits; scatter builds arrive one by one, and composing
        # early segments meanwhile is what hides the later builds, so from the first planned
        # miss on it is segment-major. Additive adds states without seams or T: segment-major only.
        if self.cfg.compose_order != "auto" or mode != "hypic" or self.cfg.compose_without_t:
            return "segment", 0
        lead = 0
        while lead < len(plan.segments) and plan.segments[lead].source == combine_pb.SOURCE_SEGCACHE:
            lead += 1
        if lead == len(plan.segments):
            return "layer", lead
        return ("mixed", lead) if lead >= 2 else ("segment", 0)

    @traced("combine.compose")
    async def _compose(self, ex: _Execution):
        """Start every segment's fetch at once. The first `lead` segments: once they are all in
        hand (even if some turned out to be misses after all), one layer-major pass. Every
        other segment is composed as soon as it and all before it are in hand: whenever the
        engine is free, the whole run of consecutive segments in hand from the next one goes in
        one layer-major pass (compose_run; one at a time with --compose-order segment or in
        additive mode). The pass that completes the prompt, when layer-major, takes the query
        along (compose_and_query). Yields a SegmentReady per segment as it arrives (any order)
        and, last, a _Composed."""
        ctx, segs, tasks, timings, lead = ex.ctx, ex.segs, ex.tasks, ex.timings, ex.lead
        arrivals: asyncio.Queue[int] = asyncio.Queue()
        for i, (seg, key, ids) in enumerate(zip(ex.plan.segments, ex.keys, segs)):
            t = asyncio.create_task(acquire(ctx, i, seg, key, ids), name=f"segment-{i}")
            t.add_done_callback(lambda _t, i=i: arrivals.put_nowait(i))
            tasks.append(t)
        additive = ex.mode == "additive"  # entries with seam 0, added without T
        in_runs = self.cfg.compose_order == "auto" and ex.mode == "hypic" and not self.cfg.compose_without_t
        n = len(segs)
        # the attention keys of every pass (and of a folded query) go into one arena
        capacity = sum(len(s) for s in segs) + len(ex.query)
        state = self.engine.new_state()
        logits = None
        ready: dict[int, Acquired] = {}
        nxt = 0  # the next segment to compose
        while nxt < n:
            while True:  # take every arrival so far; wait only while there is nothing to compose
                try:
                    i = arrivals.get_nowait()
                except asyncio.QueueEmpty:
                    if all(j in ready for j in range(nxt, max(nxt + 1, lead))):
                        break
                    try:
                        i = await asyncio.wait_for(arrivals.get(), ctx.deadline.left())
                    except asyncio.TimeoutError:
                        raise DeadlineExceeded("deadline exceeded") from None
                ready[i] = a = self._arrived(tasks[i], i, timings, ex.t_start)
                yield combine_pb.SegmentReady(index=i, source=a.source, tier=a.tier, fetch_s=a.fetch_s,
                                      build_s=a.build_s, tokens=len(segs[i]), worker=a.worker,
                                      via_nixl=a.via_nixl)
            ctx.deadline.left()
            if nxt < lead:  # nxt == 0: the leading run, from the empty state
                query = ex.query if lead == n else None
                logits, state, compose_s = await self.run(self._compose_run, state,
                                                          [ready.pop(j).entry for j in range(lead)], capacity, query,
                                                          mode=ex.mode, phase="compose")
                # Seams and bodies interleave layer by layer in this pass, so it is not split:
                # all of it is compose_s, and it adds nothing to seams_s.
                timings.compose_s += compose_s
                m.STAGE_SECONDS.labels("compose_layer_major").observe(compose_s)
                run = range(0, lead)
            else:
                run = arrived_run(ready, nxt, n) if in_runs else range(nxt, nxt + 1)
                query = ex.query if in_runs and run.stop == n else None
                logits, state = await self._compose_arrived(state, [ready.pop(j).entry for j in run], in_runs,
                                                            additive, capacity, timings, query)
            ex.runs.append(len(run))
            nxt = run.stop
        m.COMPOSITIONS.labels("layer" if lead == n else "mixed" if lead else "segment").inc()
        yield _Composed(without_arenas(state), logits)

    async def _compose_arrived(self, state, entries: list, in_runs: bool, additive: bool, capacity: int,
                               timings: router_pb.Timings, query: list[int] | None):
        """Extend the state by arrived segments: a run in one layer-major pass (seams, and the
        query when given, inside compose_s; keys into the request's arena), or one segment-major
        step (its seam timed apart). (the query's logits or None, state)"""
        logits = None
        mode = "additive" if additive else "hypic"  # the only modes that compose
        if in_runs:
            logits, state, compose_s = await self.run(self._compose_run, state, entries, capacity, query,
                                                      mode=mode, phase="compose")
            m.STAGE_SECONDS.labels("compose_run").observe(compose_s)
        else:
            (entry,) = entries
            state, compose_s, seams_s = await self.run(self._compose_one, state, entry, additive, mode=mode,
                                                           phase="compose")
            timings.seams_s += seams_s
            m.STAGE_SECONDS.labels("compose").observe(compose_s)
            m.STAGE_SECONDS.labels("seams").observe(seams_s)
        timings.compose_s += compose_s
        return logits, state

    def _arrived(self, task: asyncio.Task, i: int, timings: router_pb.Timings, t_start: float) -> Acquired:
        """Segment i's entry, now in hand, counted into the timings and metrics."""
        try:
            a = task.result()
        except (DeadlineExceeded, asyncio.CancelledError):
            raise
        except Exception as e:  # only a local build can fail here: nothing else to try
            log.exception("segment could not be built", index=i)
            raise Abort(grpc.StatusCode.INTERNAL,
                        f"segment {i} could not be built: {type(e).__name__}: {e}") from None
        timings.transfer_s = max(timings.transfer_s, a.arrived - t_start)
        if a.source == combine_pb.SOURCE_SEGCACHE:
            timings.hits += 1
            if a.tier:
                timings.hits_by_tier[a.tier] = timings.hits_by_tier.get(a.tier, 0) + 1
        else:
            timings.misses += 1
            if a.source == combine_pb.SOURCE_SCATTER:
                timings.scatter_s = max(timings.scatter_s, a.arrived - t_start)
        m.SEGMENTS.labels(SOURCES[a.source], "nixl" if a.via_nixl else
                          "local" if a.source == combine_pb.SOURCE_LOCAL else "grpc").inc()
        return a

    def _compose_one(self, state, entry, additive: bool):
        """Engine thread: extend the state by one segment (seam recompute + cached body)."""
        timer = _SeamTimer(self.engine)
        t = time.perf_counter()
        state = compose_segment(timer, state, entry, additive=additive, without_t=self.cfg.compose_without_t)
        total = time.perf_counter() - t
        return state, total - timer.seconds, timer.seconds

    def _compose_run(self, state, entries: list, capacity: int, query: list[int] | None):
        """Engine thread: extend the state by a run of consecutive segments in one layer-major
        pass, the query too when given (the run completes the prompt). (logits or None, state, s)"""
        t = time.perf_counter()
        logits = None
        if query:
            logits, state = compose_and_query(self.engine, state, entries, query, capacity=capacity)
        else:
            state = compose_run(self.engine, state, entries, capacity=capacity)
        return logits, state, time.perf_counter() - t

    @torch.inference_mode()
    def _query(self, query: list[int], state):
        """Engine thread: the query as one chunk from the composed state (as prefill_segments)."""
        _, logits, state = self.engine.forward(query, state)
        return logits[-1], state

    def _baseline(self, mode: str, segs: list[list[int]], query: list[int]):
        """Engine thread: full recompute, or this worker's own prefix cache. (logits, state,
        segments recomputed: all but those of the cached prefix reused)"""
        if mode == "full":
            out = self.engine.prefill([t for s in segs for t in s] + query)
            return out.logits, out.state, len(segs)
        out = prefill_segments(self.engine, segs, query, mode="prefix")
        return out.logits, out.state, len(segs) - out.extra["reused_segments"]

    @torch.inference_mode()
    def _step(self, tok: int, state, pick: Callable, greedy: bool = False):
        """Engine thread: one decode step; `greedy` (shadowed plans only): also the argmax, which
        costs a pass over the vocabulary (and a device sync) that other plans need not pay."""
        logits, state = self.engine.decode_step(tok, state)
        return pick(logits), int(logits.argmax()) if greedy else 0, state
