"""The hypic.v1.Router gRPC servicer (grpc.aio).

Generate: validate → tokenize → cut long segments into cache pieces (common/engine/cut.py; the
plan, keys, trace and Timings.segments count pieces) → keys → segcache Lookup (best effort) → LPT plan of the misses →
combine.Execute(plan) (least loaded combine first, the next one on UNAVAILABLE) → forward tokens
(detokenized) and timings; SegmentReady events feed the planner's cost model and load books.
Every downstream call carries x-request-id and the remaining deadline; a client that goes away
cancels the combine stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from concurrent.futures import Executor
from typing import Any, AsyncIterator

import grpc
import structlog

from common.engine import modes
from common.engine.cut import cut_segments
from common.engine.fingerprint import segment_key
from common.mesh.abort import Abort
from common.mesh.checks import check_temperature
from common.mesh.discovery import MemberSet
from common.mesh.guard import internal_details
from common.mesh.log import REQUEST_ID_KEY, sanitize_request_id
from common.mesh.segcache_ring import SegcacheRing
from common.mesh.tracing import traced
from common.mesh.channels import channel_options, open_channel
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.router import metrics as m
from services.router.claims import Claimed, claim_misses
from services.router.config import RouterConfig
from services.router.drift_guard import DriftGuard
from services.router.model import ModelInfo
from services.router.planner import CostModel, Job, Planner
from services.router.pools import CombinePool, ScatterPool
from services.router.request import RequestState, norm_tier, tier_name
from services.router.shadow import ShadowCapture, ShadowMonitor

log = structlog.get_logger("router.servicer")

SERVICE_NAME = "hypic.v1.Router"


def stop_at_eos(request: router_pb.GenerateRequest) -> bool:
    """Whether to stop at EOS: as the request says, true when it says nothing."""
    return request.stop_at_eos if request.HasField("stop_at_eos") else True


class RouterServicer(router_grpc.RouterServicer):
    def __init__(self, cfg: RouterConfig, model: ModelInfo, executor: Executor):
        self.cfg = cfg
        self.model = model
        self.executor = executor
        # Reconnect quickly after a peer restarts; the connect timeout (gRPC's min backoff, 20 s)
        # stays gRPC's default.
        options = channel_options(cfg.max_message_bytes, min_backoff_ms=None)
        self.planner = Planner(0, CostModel(cfg.cost_prior))
        # Static lists are members from the start; dns:/// targets fill in at start_background.
        self.combines = CombinePool(cfg.combines, options, cfg.combine_cooldown_s, tls=cfg)
        self.scatters = ScatterPool(cfg.scatters, options, self.planner,
                                    model.fingerprint, cfg.load_timeout_s, tls=cfg)
        self.discovery = [
            MemberSet(cfg.scatter_target, refresh_s=cfg.discovery_refresh_s,
                      listener=self.scatters.apply, what="scatter"),
            MemberSet(cfg.combine_target, refresh_s=cfg.discovery_refresh_s,
                      listener=self.combines.apply, what="combine")]
        self.segcache: SegcacheRing | None = None
        if cfg.segcache_address:  # many, or dns:///name:port (keys placed by rendezvous hashing)
            self.segcache = SegcacheRing(
                cfg.segcache_address, open_channel=lambda a: open_channel(a, options, cfg),
                timeout_s=cfg.lookup_timeout_s, max_message_bytes=cfg.max_message_bytes,
                refresh_s=cfg.discovery_refresh_s)
        self.holder = f"router-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # build claims' holder
        self.guard = DriftGuard(cfg)
        self.in_flight = 0
        self._tasks: list[asyncio.Task] = []
        self.shadow = ShadowMonitor(cfg, self.combines, model.fingerprint, cfg.model.name)
        self.shadow.listeners.append(self._on_shadow_result)  # the guard learns from every shadow
        self._publish_cost()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start_background(self) -> None:
        """Resolve the members once (so the first request sees them), then keep them current."""
        if self.segcache is not None:
            await self.segcache.start()  # a dns: target: resolved now, then re-resolved
        for ms in self.discovery:
            if ms.target.is_dns:
                await ms.refresh()
                self._tasks.append(asyncio.create_task(ms.run()))
        if self.cfg.scatter_addresses and self.cfg.load_poll_s > 0:
            self._tasks.append(asyncio.create_task(self.scatters.run(self.cfg.load_poll_s)))
        self.shadow.start()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.shadow.close()
        await self.combines.close()
        await self.scatters.close()
        if self.segcache is not None:
            await self.segcache.close()

    def _publish_cost(self) -> None:
        for name, v in zip("abc", self.planner.cost.coefficients):
            m.COST_COEF.labels(name).set(v)

    def _publish_loads(self) -> None:
        for w, a in enumerate(self.scatters.addresses):
            m.WORKER_LOAD.labels(a).set(self.planner.load(w))

    # ---- Info ----------------------------------------------------------------------------------
    async def Info(self, request: router_pb.InfoRequest, context) -> router_pb.InfoResponse:
        return router_pb.InfoResponse(
            model_type=self.model.model_type, model_fingerprint=self.model.fingerprint,
            vocab_size=self.model.vocab_size, seam=self.cfg.seam, dtype=self.cfg.dtype,
            max_prompt_tokens=self.cfg.max_prompt_tokens,
            scatter_addresses=self.scatters.members,
            combine_addresses=self.combines.addresses, segcache_address=self.cfg.segcache_address,
            model_path=str(self.cfg.model), drift=self._drift_summary())

    def _drift_summary(self) -> router_pb.DriftSummary:
        """The shadow monitor's rolling figures with the guard's state."""
        summary = self.shadow.summary()
        g = self.guard.summary()
        summary.guard_enabled, summary.guard_seam, summary.guard_full = g.enabled, g.seam, g.full
        return summary

    def _on_shadow_result(self, result, seam: int) -> None:
        """A shadow monitor listener: the guard learns how far answers served with `seam` drift
        (`result`: a ShadowOutcome or a ShadowResult; the guard reads kl, top1_agree, agreement)."""
        self.guard.observe(result.kl, result.top1_agree, result.agreement, seam)

    # ---- Generate ------------------------------------------------------------------------------
    async def Generate(self, request: router_pb.GenerateRequest, context) -> AsyncIterator[router_pb.GenerateEvent]:
        t0 = time.perf_counter()
        rid = sanitize_request_id(request.request_id) or \
            structlog.contextvars.get_contextvars().get("request_id") or ""
        structlog.contextvars.bind_contextvars(request_id=rid)
        remaining = context.time_remaining()
        budget = self.cfg.request_timeout_s if remaining is None else remaining
        req = RequestState(rid=rid, mode=request.mode, t0=t0, deadline=time.monotonic() + budget)
        code = "OK"
        if self.in_flight >= self.cfg.max_in_flight:
            m.REQUESTS.labels(req.mode_name, "RESOURCE_EXHAUSTED").inc()
            log.warning("rejected: too many requests in flight", in_flight=self.in_flight)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.in_flight} requests in flight (max_in_flight "
                                f"{self.cfg.max_in_flight}); retry later")
        self.in_flight += 1
        m.IN_FLIGHT.set(self.in_flight)
        shadow = None  # sampled: what the shadow keeps of the answer (services/router/shadow.py)
        try:
            await self._prepare(request, req)
            plan = await self._plan(request, req)
            shadow = self.shadow.sample(plan, req)
            async with contextlib.aclosing(self._execute(plan, req, shadow)) as events:
                async for ev in events:
                    yield ev
        except Abort as e:
            code = e.code.name
            log.info("request failed", code=code, details=e.details)
            await e.send(context)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            code = "CANCELLED"
            log.info("request cancelled", tokens_sent=req.tokens_sent)
            raise
        except Exception as e:
            code = "INTERNAL"
            log.exception("internal error", error=f"{type(e).__name__}: {e}")
            await context.abort(grpc.StatusCode.INTERNAL, internal_details())
        finally:
            self.in_flight -= 1
            m.IN_FLIGHT.set(self.in_flight)
            m.REQUESTS.labels(req.mode_name, code).inc()
            if req.ticket is not None:
                self.planner.release(req.ticket)
                self._publish_loads()
            if shadow is not None:
                self.shadow.finish(shadow)  # an answer that did not complete: dropped, counted

    # ---- stages --------------------------------------------------------------------------------
    async def _prepare(self, request: router_pb.GenerateRequest, req: RequestState) -> None:
        """Validate and tokenize (INVALID_ARGUMENT on anything malformed)."""
        cfg = self.cfg
        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            modes.from_wire(request.mode)
        except ValueError as e:
            raise Abort(bad, str(e)) from None
        if not request.segments:
            raise Abort(bad, "no segments")
        if len(request.segments) > cfg.max_segments:
            raise Abort(bad, f"{len(request.segments)} segments; at most {cfg.max_segments}")
        if request.max_tokens <= 0:
            raise Abort(bad, "max_tokens must be > 0")
        if request.max_tokens > cfg.max_tokens_limit:
            raise Abort(bad, f"max_tokens {request.max_tokens} over the limit {cfg.max_tokens_limit}")
        check_temperature(request.temperature)
        if not (math.isfinite(request.top_p) and 0 <= request.top_p <= 1):
            raise Abort(bad, "top_p must be in [0, 1]")
        parts = list(request.segments) + [request.query]
        names = [f"segment {i}" for i in range(len(request.segments))] + ["query"]
        ids: list[list[int] | None] = []
        texts: list[tuple[int, str]] = []
        for i, (seg, name) in enumerate(zip(parts, names)):
            if seg.text and len(seg.token_ids):
                raise Abort(bad, f"{name} mixes text and token ids")
            if not seg.text and not len(seg.token_ids):
                raise Abort(bad, f"{name} is empty")
            if seg.text:
                texts.append((i, seg.text))
                ids.append(None)
            else:
                ids.append(list(seg.token_ids))
        if texts:
            if self.model.tokenizer is None:
                raise Abort(bad, "the model has no tokenizer: send token ids")
            # A prompt's text can be at most ~max_prompt_tokens * a generous bytes-per-token.
            chars = sum(len(t) for _, t in texts)
            if chars > 64 * cfg.max_prompt_tokens:
                raise Abort(bad, f"prompt text of {chars} characters is over max_prompt_tokens")
            t = time.perf_counter()
            loop = asyncio.get_running_loop()
            encoded = await loop.run_in_executor(self.executor, self.model.encode_batch,
                                                 [t for _, t in texts])
            req.tokenize_s = time.perf_counter() - t
            m.STAGE.labels("tokenize").observe(req.tokenize_s)
            for (i, _), e in zip(texts, encoded):
                if not e:
                    raise Abort(bad, f"{names[i]} tokenizes to no tokens")
                ids[i] = e
        vocab = self.model.vocab_size
        total = 0
        for seq, name in zip(ids, names):
            top = max(seq)
            if top >= vocab:
                raise Abort(bad, f"{name}: token id {top} outside the vocabulary [0, {vocab})")
            total += len(seq)
        if total > cfg.max_prompt_tokens:
            raise Abort(bad, f"prompt of {total} tokens is over max_prompt_tokens "
                              f"({cfg.max_prompt_tokens})")
        req.segments = self._cut(request, ids[:-1])  # type: ignore[arg-type]
        req.query = ids[-1]  # type: ignore[assignment]
        req.prompt_tokens = total

    def _cut(self, request: router_pb.GenerateRequest, segments: list[list[int]]) -> list[list[int]]:
        """Long segments as cache pieces (common/engine/cut.py) in the modes that cache entries;
        full and prefix see the segments as sent (a cut would change only prefix's alignment)."""
        if request.keep_whole or not modes.uses_entries(modes.from_wire(request.mode)):
            return segments
        pieces, _ = cut_segments(segments, self.cfg.cut_tokens)
        return pieces

    async def _claim_misses(self, keys: list[str], req: RequestState) -> Claimed:
        """Claim the misses (services.router.claims)."""
        cfg = self.cfg
        if self.segcache is None or not keys or cfg.claim_lease_s <= 0:
            return Claimed()
        t = time.perf_counter()
        holder = f"{self.holder}/{uuid.uuid4().hex[:12]}"  # per request: two requests, one build
        budget = min(cfg.lookup_timeout_s, 0.5 * req.remaining())
        claimed = await claim_misses(self.segcache, keys, holder, cfg.claim_lease_s,
                                     min(cfg.claim_wait_s, 0.5 * req.remaining()), req.rid, budget)
        m.STAGE.labels("claim").observe(time.perf_counter() - t)
        return claimed

    def _segcache_instances(self) -> str:
        return ",".join(self.segcache.healthy()) if self.segcache is not None else ""

    def _md(self, req: RequestState) -> list[tuple[str, str]]:
        return [(REQUEST_ID_KEY, req.rid)]

    @traced("router.lookup")
    async def _lookup(self, keys: list[str], req: RequestState) -> dict[str, segcache_pb.EntryInfo]:
        """Which keys segcache holds; any failure or slowness means "all misses"."""
        if self.segcache is None or not keys:
            return {}
        t = time.perf_counter()
        # A slow segcache may not eat the request: at most half of what is left of the deadline.
        budget = min(self.cfg.lookup_timeout_s, 0.5 * req.remaining())
        found: dict[str, segcache_pb.EntryInfo] = {}
        try:
            if budget <= 0:
                raise asyncio.TimeoutError
            # Batched per instance and concurrent; a down or slow instance's keys come back
            # as misses (SegcacheRing.lookup).
            entries, asked, failed = await asyncio.wait_for(
                self.segcache.lookup_reporting(keys, request_id=req.rid, timeout=budget), budget)
            for e in entries:
                if e.tier != segcache_pb.TIER_MISS:
                    found[e.key] = e
            if failed:
                m.LOOKUP_FAILURES.inc()
                if len(failed) == len(asked):
                    log.warning("segcache lookup failed; serving every segment as a miss",
                                failed=failed, budget_s=round(budget, 3))
                else:
                    log.warning("segcache lookup failed on some instances; their segments are misses",
                                failed=failed, budget_s=round(budget, 3))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as e:
            m.LOOKUP_FAILURES.inc()
            detail = e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
            log.warning("segcache lookup failed; serving every segment as a miss",
                        error=detail, budget_s=round(budget, 3))
            found = {}
        req.lookup_s = time.perf_counter() - t
        m.STAGE.labels("lookup").observe(req.lookup_s)
        return found

    @traced("router.plan")
    async def _plan(self, request: router_pb.GenerateRequest, req: RequestState) -> combine_pb.Plan:
        cfg = self.cfg
        mode = modes.from_wire(request.mode)
        seam = modes.seam_for(mode, cfg.seam)
        if mode == "hypic":  # the drift guard's width, or full recompute past the widest
            guard_seam, full = self.guard.current()
            if full:
                mode, req.served_mode = "full", router_pb.PREFILL_MODE_FULL
            else:
                seam = guard_seam
        cached_modes = modes.uses_entries(mode)
        plan = combine_pb.Plan(
            request_id=req.rid, query=req.query, seam=seam,
            model_fingerprint=self.model.fingerprint, dtype=cfg.dtype, mode=req.served_mode,
            max_tokens=request.max_tokens, temperature=request.temperature, top_k=request.top_k,
            seed=request.seed, return_logits=request.return_logits,
            stop_at_eos=stop_at_eos(request), top_p=request.top_p,
            # The instances this router placed keys over: combine places them the same way.
            segcache_address=self._segcache_instances() if cached_modes else "",
            store_entries=bool(cfg.segcache_address) and cached_modes)
        if not cached_modes:
            # full / prefix: combine prefills the tokens itself; no keys, no lookup.
            for ids in req.segments:
                plan.segments.add(token_ids=ids, source=combine_pb.SOURCE_LOCAL)
            return plan
        keys = [segment_key(self.model.fingerprint, seam, cfg.dtype, ids) for ids in req.segments]
        unique = list(dict.fromkeys(keys))
        found = await self._lookup(unique, req)
        claimed = await self._claim_misses([k for k in unique if k not in found], req)
        # Stored since the lookup, or being built by another request: read from segcache.
        elsewhere = {k: 0.0 for k in claimed.cached} | claimed.waiting
        t = time.perf_counter()
        jobs = []
        for i, (key, ids) in enumerate(zip(keys, req.segments)):
            e = found.get(key)
            if e is not None:
                req.planned_tiers[i] = tier_name(e.tier)
            elif key not in elsewhere:
                jobs.append(Job(i, key, len(ids)))
        req.planned_misses = len(jobs)
        req.seam = seam
        assigned: dict[int, Any] = {}
        # The plan names present members only (combine falls back along this list, and a member
        # that left may be gone): planner index -> position in it.
        slots = self.scatters.present_slots()
        position = {w: k for k, w in enumerate(slots)}
        plan.scatter_addresses.extend(self.scatters.addresses[w] for w in slots)
        if jobs and slots and self.planner.up_workers():
            req.ticket = self.planner.assign(jobs)
            assigned = {a.index: a for a in req.ticket.assignments}
            self._publish_loads()
        for i, (key, ids) in enumerate(zip(keys, req.segments)):
            if i in req.planned_tiers:
                plan.segments.add(key=key, token_ids=ids, source=combine_pb.SOURCE_SEGCACHE,
                                  est_cost_s=found[key].recompute_cost_s)
            elif key in elsewhere:
                plan.segments.add(key=key, token_ids=ids, source=combine_pb.SOURCE_SEGCACHE,
                                  wait_s=elsewhere[key],
                                  est_cost_s=self.planner.cost.predict(len(ids)))
            elif i in assigned:
                a = assigned[i]
                plan.segments.add(key=key, token_ids=ids, source=combine_pb.SOURCE_SCATTER,
                                  worker=position.get(a.worker, 0), est_cost_s=a.est_s)
            else:
                plan.segments.add(key=key, token_ids=ids, source=combine_pb.SOURCE_LOCAL,
                                  est_cost_s=self.planner.cost.predict(len(ids)))
        m.STAGE.labels("plan").observe(time.perf_counter() - t)
        log.info("planned", segments=len(keys), seam=seam, hits=len(req.planned_tiers),
                 misses=len(jobs), built_elsewhere=len(elsewhere), prompt_tokens=req.prompt_tokens, mode=req.mode_name,
                 workers=[a.worker for a in (req.ticket.assignments if req.ticket else [])])
        return plan

    def _on_segment(self, plan: combine_pb.Plan, req: RequestState, ready: combine_pb.SegmentReady) -> None:
        i = ready.index
        if i >= len(plan.segments):
            log.warning("SegmentReady for an unknown index", index=i)
            return
        ps = plan.segments[i]
        tier = norm_tier(ready.tier) or req.planned_tiers.get(i, "")
        req.ready[i] = (ready.source, tier)
        req.trace[i] = router_pb.SegmentTrace(
            index=i, source=combine_pb.SegmentSource.Name(ready.source).removeprefix("SOURCE_").lower()
            if ready.source in combine_pb.SegmentSource.values() else "unknown",
            worker=ready.worker, tier=tier, fetch_s=ready.fetch_s, build_s=ready.build_s,
            tokens=ready.tokens or len(ps.token_ids), via_nixl=ready.via_nixl)
        m.SEGMENTS.labels(combine_pb.SegmentSource.Name(ready.source).removeprefix("SOURCE_").lower()
                          if ready.source in combine_pb.SegmentSource.values() else "unknown").inc()
        if req.ticket is not None and ps.key:
            build_s = ready.build_s if ready.source == combine_pb.SOURCE_SCATTER else 0.0
            if self.planner.complete(req.ticket, ps.key, tokens=ready.tokens or len(ps.token_ids),
                                     build_s=build_s):
                m.COST_OBS.inc()
                self._publish_cost()
            self._publish_loads()

    async def _execute(self, plan: combine_pb.Plan, req: RequestState,
                       shadow: ShadowCapture | None = None) -> AsyncIterator[router_pb.GenerateEvent]:
        md = self._md(req)
        detok = self.model.detokenizer()
        last_error = ""
        for c in self.combines.order():
            remaining = req.remaining()
            if remaining <= 0:
                raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before combine")
            # Stop a little before the client's deadline so that an unreachable combine can be
            # reported as UNAVAILABLE while the client still listens.
            timeout = remaining - min(0.25, 0.1 * remaining)
            call = c.stub.Execute(plan, timeout=timeout, metadata=md)
            c.in_flight += 1
            received = False
            try:
                async for ev in call:
                    received = True
                    kind = ev.WhichOneof("event")
                    if kind == "segment":
                        self._on_segment(plan, req, ev.segment)
                    elif kind == "token":
                        tok = router_pb.TokenEvent()
                        tok.CopyFrom(ev.token)
                        if shadow is not None:  # keeps the shadow's part, strips it from the client's
                            shadow.take(tok)
                        if detok is not None:
                            tok.text = detok.push(tok.token_id)
                        first = req.tokens_sent == 0
                        if first:
                            req.ttft_s = time.perf_counter() - req.t0
                            m.TTFT.labels(req.mode_name).observe(req.ttft_s)
                        req.tokens_sent += 1
                        yield router_pb.GenerateEvent(request_id=req.rid, token=tok)
                        if first:
                            yield router_pb.GenerateEvent(request_id=req.rid,
                                                   timings=req.timings(final=False))
                    elif kind == "timings":
                        req.combine_timings.CopyFrom(ev.timings)
                        req.combine_reported = True
                final = req.timings(final=True)
                log.info("done", combine=c.address, tokens=req.tokens_sent,
                         ttft_s=round(req.ttft_s, 4), total_s=round(final.total_s, 4),
                         hits=final.hits, misses=final.misses)
                if shadow is not None:
                    self.shadow.submit(plan, shadow)
                yield router_pb.GenerateEvent(request_id=req.rid, timings=final, done=True)
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                unreachable = (code == grpc.StatusCode.UNAVAILABLE or
                               (code == grpc.StatusCode.DEADLINE_EXCEEDED and not received
                                and not c.connected()))
                if unreachable and req.tokens_sent == 0:
                    self.combines.failed(c)
                    m.COMBINE_FAILOVERS.labels(c.address).inc()
                    last_error = code.name
                    log.warning("combine unavailable; trying the next", combine=c.address,
                                code=code.name, details=e.details())
                    continue
                # Addresses stay in the log; the client gets the status and combine's message
                # (combine's messages name no address or exception text either).
                log.warning("combine failed", combine=c.address, code=code.name, details=e.details())
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise Abort(code, "deadline exceeded") from None
                raise Abort(code, f"combine: {e.details()}") from None
            finally:
                self.combines.done(c)
                call.cancel()
        log.warning("no combine service available", combines=list(self.cfg.combine_addresses),
                    last_error=last_error)
        raise Abort(grpc.StatusCode.UNAVAILABLE,
                    f"no combine service available ({last_error or 'no combine member'}; "
                    f"request id {req.rid})")
