"""The router's shadow monitor (issue 26, docs/drift.md): sample hypic requests, keep what hypic
served, have it recomputed in full on an idle combine (Combine.Shadow), record the drift.

One job, in four steps:
- sample: `sample(plan, req)` marks a hypic plan `shadow` at --shadow-rate (combine then sends the
  query's logits and every step's greedy pick) and returns its ShadowCapture;
- keep: the ShadowCapture takes the first --shadow-steps tokens of the answer, their greedy picks
  and the query's logits, and strips them from what the client gets (logits only when it asked
  return_logits; argmax_id never);
- queue: `submit` puts the job into a bounded queue without waiting (full: dropped and counted);
  a sampled request that ends without a complete answer is dropped by `finish` (counted);
- run and record: one background worker takes jobs one at a time and calls Shadow on a combine
  this router has no request in flight on (none idle for a while, or combine refuses: dropped
  and counted); each result goes to the Prometheus metrics, a rolling window (Router.Info's
  DriftSummary), a log line when it crosses a threshold, and every listener(result, seam).

Nothing here runs on a request's path but `sample`, `ShadowCapture.take`, `submit` and `finish`,
none of which waits: a user's request is never delayed by a shadow.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import random
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import structlog

from common.mesh.log import REQUEST_ID_KEY
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from services.router import metrics as m

log = structlog.get_logger("router.shadow")

IDLE_POLL_S = 0.02
SHADOW_TIMEOUT_S = 30.0  # one Shadow call


@dataclass
class ShadowCapture:
    """What a shadowed request served: its first `steps` tokens, their greedy picks and the
    query's logits. `take` strips them from the event the client gets."""
    steps: int
    client_logits: bool  # the client asked return_logits: the first token's logits stay
    seam: int = 0
    submitted: bool = False  # submit or finish has accounted for it
    generated: list[int] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)
    logits: array = field(default_factory=lambda: array("f"))

    def take(self, tok: router_pb.TokenEvent) -> None:
        if tok.index == 0 and not self.logits:
            self.logits = array("f", tok.logits)
        if len(self.generated) < self.steps:
            self.generated.append(tok.token_id)
            self.argmax.append(tok.argmax_id)
        tok.ClearField("argmax_id")
        if not self.client_logits:
            tok.ClearField("logits")


@dataclass
class ShadowJob:
    request_id: str
    seam: int
    prompt: list[int]
    capture: ShadowCapture


# dropped{reason}: a closed set. unfinished: the sampled request ended without a complete answer.
DROP_REASONS = ("queue_full", "no_idle_combine", "busy", "unavailable", "error", "unfinished")


@dataclass(frozen=True)
class ShadowOutcome:
    """One shadow's figures (what listeners get, with the seam width it was served at)."""
    request_id: str
    seam: int
    kl: float
    top1_agree: bool
    agreement: float
    steps: int
    over_threshold: bool


class BucketCounts:
    """One figure's distribution at one seam width in Prometheus's bucket layout, kept by the
    monitor itself (the registry's histograms are process-wide) for Router.Info: the front
    re-exports them (services/front/drift_figures.py)."""

    def __init__(self, upper_bounds: tuple[float, ...]):
        self.upper_bounds = upper_bounds
        self.counts = [0] * (len(upper_bounds) + 1)  # the last: over the largest bound
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, x)] += 1
        self.sum += x

    def to_proto(self, figure: str, seam: int) -> router_pb.DriftHistogram:
        return router_pb.DriftHistogram(figure=figure, seam=seam, upper_bounds=self.upper_bounds,
                                        counts=self.counts, sum=self.sum)


HISTOGRAM_BOUNDS = {"kl": m.KL_BUCKETS, "agreement": m.AGREEMENT_BUCKETS}


class ShadowMonitor:
    """Sampling, the queue, the worker and the records (see the module docstring)."""

    def __init__(self, cfg: Any, combines: Any, fingerprint: str, model_label: str,
                 rng: random.Random | None = None):
        self.cfg = cfg
        self.combines = combines  # services.router.pools.CombinePool
        self.fingerprint = fingerprint
        self.model_label = model_label
        self.rng = rng or random.Random()
        self.queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize=cfg.shadow_queue)
        self.window: deque[ShadowOutcome] = deque(maxlen=cfg.drift_window)
        self.listeners: list[Callable[[ShadowOutcome, int], None]] = []
        self.sampled = self.shadowed = self.dropped = self.over_threshold = 0
        # (figure, seam) -> its distribution; seams are the guard's few widths, so this stays small
        self.histograms: dict[tuple[str, int], BucketCounts] = {}
        self._task: asyncio.Task | None = None

    # ---- on the request's path (none of these waits) -------------------------------------------
    def sample(self, plan: Any, req: Any) -> ShadowCapture | None:
        """A hypic plan sampled at --shadow-rate is marked (plan.shadow, req.shadowed): its
        capture, which the request's end must reach (submit, or finish); else None."""
        rate = self.cfg.shadow_rate
        if plan.mode != router_pb.PREFILL_MODE_HYPIC or rate <= 0 or self.rng.random() >= rate:
            return None
        plan.shadow = True
        req.shadowed = True
        self.sampled += 1
        m.SHADOW_SAMPLED.labels(self.model_label, str(plan.seam)).inc()
        return ShadowCapture(self.cfg.shadow_steps, plan.return_logits, seam=plan.seam)

    def submit(self, plan: Any, capture: ShadowCapture) -> None:
        """Queue the shadow of a complete answer; a full queue drops it."""
        capture.submitted = True
        if not capture.generated or not capture.logits:
            self._drop(capture.seam, "unfinished")
            return
        prompt = [t for s in plan.segments for t in s.token_ids] + list(plan.query)
        job = ShadowJob(plan.request_id, plan.seam, prompt, capture)
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self._drop(job.seam, "queue_full")

    def finish(self, capture: ShadowCapture) -> None:
        """The request has ended: a capture never submitted (failed, cancelled) is dropped."""
        if not capture.submitted:
            capture.submitted = True
            self._drop(capture.seam, "unfinished")

    # ---- the background worker ------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.shadow_rate > 0 and self._task is None:
            self._task = asyncio.create_task(self.run(), name="shadow-monitor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def run(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self.shadow_one(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the worker die
                log.exception("shadow failed", request_id=job.request_id)
                self._drop(job.seam, "error")

    async def _idle_combine(self) -> Any | None:
        """A combine with no request of this router in flight (waits up to --shadow-idle-wait-s)."""
        deadline = time.monotonic() + self.cfg.shadow_idle_wait_s
        while True:
            now = time.monotonic()
            idle = [c for c in self.combines.items if c.in_flight == 0 and c.cooldown_until <= now]
            if idle:
                return idle[0]
            if now >= deadline:
                return None
            await asyncio.sleep(IDLE_POLL_S)

    async def shadow_one(self, job: ShadowJob) -> ShadowOutcome | None:
        c = await self._idle_combine()
        if c is None:
            self._drop(job.seam, "no_idle_combine")
            return None
        request = combine_pb.ShadowRequest(
            request_id=job.request_id, model_fingerprint=self.fingerprint, prompt=job.prompt,
            generated=job.capture.generated, hypic_argmax=job.capture.argmax,
            hypic_logits=job.capture.logits)
        c.in_flight += 1  # user requests prefer another combine meanwhile; no other shadow here
        try:
            result = await c.stub.Shadow(request, timeout=SHADOW_TIMEOUT_S,
                                         metadata=[(REQUEST_ID_KEY, job.request_id)])
        except grpc.aio.AioRpcError as e:
            code = e.code()
            reason = ("busy" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else
                      "unavailable" if code == grpc.StatusCode.UNAVAILABLE else "error")
            log.info("shadow dropped", request_id=job.request_id, combine=c.address, code=code.name,
                     details=e.details())
            self._drop(job.seam, reason)
            return None
        finally:
            self.combines.done(c)
        return self.record(job.request_id, job.seam, result)

    # ---- records ---------------------------------------------------------------------------------
    def _drop(self, seam: int, reason: str) -> None:
        self.dropped += 1
        m.SHADOW_DROPPED.labels(self.model_label, str(seam), reason).inc()

    def record(self, request_id: str, seam: int, result: combine_pb.ShadowResult) -> ShadowOutcome:
        cfg = self.cfg
        over = result.kl > cfg.drift_kl_max or result.agreement < cfg.drift_agreement_min
        out = ShadowOutcome(request_id, seam, result.kl, result.top1_agree, result.agreement,
                            result.steps, over)
        labels = (self.model_label, str(seam))
        self.shadowed += 1
        self.window.append(out)
        m.SHADOW_COMPUTED.labels(*labels).inc()
        m.SHADOW_KL.labels(*labels).observe(out.kl)
        m.SHADOW_AGREEMENT.labels(*labels).observe(out.agreement)
        for figure, x in (("kl", out.kl), ("agreement", out.agreement)):
            key = (figure, seam)
            if key not in self.histograms:
                self.histograms[key] = BucketCounts(HISTOGRAM_BOUNDS[figure])
            self.histograms[key].observe(x)
        m.SHADOW_TOP1.labels(*labels, "true" if out.top1_agree else "false").inc()
        log.info("shadow recorded", request_id=request_id, kl=round(out.kl, 6), top1_agree=out.top1_agree,
                 agreement=round(out.agreement, 4), steps=out.steps, seam=seam,
                 compute_s=round(result.compute_s, 4))
        if over:
            self.over_threshold += 1
            m.SHADOW_OVER.labels(*labels).inc()
            log.warning("drift over threshold", request_id=request_id, kl=round(out.kl, 6),
                        agreement=round(out.agreement, 4), top1_agree=out.top1_agree, seam=seam,
                        kl_max=cfg.drift_kl_max, agreement_min=cfg.drift_agreement_min)
        for listener in list(self.listeners):
            try:
                listener(out, seam)
            except Exception:  # a listener's bug must not stop the records
                log.exception("shadow listener failed", listener=repr(listener))
        return out

    def summary(self) -> router_pb.DriftSummary:
        """The rolling figures for Router.Info (the guard_* fields are the guard's to fill)."""
        n = len(self.window)
        return router_pb.DriftSummary(
            sample_rate=self.cfg.shadow_rate, sampled=self.sampled, shadowed=self.shadowed,
            dropped=self.dropped, over_threshold=self.over_threshold, window=n,
            kl_mean=sum(o.kl for o in self.window) / n if n else 0.0,
            top1_rate=sum(o.top1_agree for o in self.window) / n if n else 0.0,
            agreement_mean=sum(o.agreement for o in self.window) / n if n else 0.0,
            histograms=[h.to_proto(figure, seam) for (figure, seam), h in sorted(self.histograms.items())])
