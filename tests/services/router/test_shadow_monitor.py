"""The router's shadow monitor (services/router/shadow.py) in process: sampling (hypic only, at the
rate), what a capture keeps and strips from the client's events, the queue bound (dropped and
counted, never waited on), drops when no combine is idle or combine is unreachable, and the
records: rolling summary, threshold log line, listeners."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest
import structlog
from prometheus_client import REGISTRY

from common.mesh.channels import channel_options
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from services.router import shadow as shadow_mod
from services.router.config import RouterConfig
from services.router.pools import CombinePool
from services.router.request import RequestState
from services.router.shadow import ShadowCapture, ShadowMonitor

MODEL = "test-model"


def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def dropped(reason: str, seam: str = "8") -> float:
    return REGISTRY.get_sample_value("hypic_shadow_dropped_total",
                                     {"model": MODEL, "seam": seam, "reason": reason}) or 0.0


def monitor(pool=None, rng_seed: int = 0, **cfg) -> ShadowMonitor:
    c = RouterConfig(**{"shadow_rate": 1.0, **cfg})
    return ShadowMonitor(c, pool, "fp", MODEL, rng=random.Random(rng_seed))


def plan(mode=router_pb.PREFILL_MODE_HYPIC, rid="r", **kw) -> combine_pb.Plan:
    return combine_pb.Plan(request_id=rid, mode=mode, seam=8, query=[5, 6],
                           segments=[combine_pb.PlannedSegment(token_ids=[1, 2, 3])], **kw)


def req() -> RequestState:
    return RequestState(rid="r", mode=0, t0=0.0, deadline=0.0)


def captured(steps: int = 4, n: int = 3) -> ShadowCapture:
    cap = ShadowCapture(steps, client_logits=False, seam=8)
    for i in range(n):
        cap.take(router_pb.TokenEvent(token_id=10 + i, index=i, argmax_id=20 + i,
                                      logits=[0.5, 1.5] if i == 0 else []))
    return cap


def test_sampling_is_hypic_only_at_the_rate():
    mon = monitor()
    for mode in (router_pb.PREFILL_MODE_FULL, router_pb.PREFILL_MODE_PREFIX, router_pb.PREFILL_MODE_ADDITIVE):
        p, r = plan(mode), req()
        mon.sample(p, r)
        assert not p.shadow and not r.shadowed
    p, r = plan(), req()
    cap = mon.sample(p, r)
    assert p.shadow and r.shadowed and mon.sampled == 1
    assert (cap.steps, cap.seam, cap.client_logits) == (16, 8, False)
    off = monitor(shadow_rate=0.0)
    p = plan()
    assert off.sample(p, req()) is None
    assert not p.shadow and off.sampled == 0
    tenth = monitor(shadow_rate=0.1, rng_seed=1)
    for _ in range(4000):
        tenth.sample(plan(), req())
    assert 0.085 < tenth.sampled / 4000 < 0.115, tenth.sampled


def test_capture_keeps_the_shadows_part_and_strips_it_from_the_client():
    cap = ShadowCapture(2, client_logits=False)
    events = [router_pb.TokenEvent(token_id=10 + i, index=i, argmax_id=20 + i, logits=[0.5, 1.5] if i == 0 else [])
              for i in range(3)]
    for ev in events:
        cap.take(ev)
    assert cap.generated == [10, 11] and cap.argmax == [20, 21] and list(cap.logits) == [0.5, 1.5]
    assert all(not ev.argmax_id and not ev.logits for ev in events)
    asked = ShadowCapture(2, client_logits=True)
    first = router_pb.TokenEvent(token_id=1, index=0, argmax_id=2, logits=[0.25])
    asked.take(first)
    assert list(first.logits) == [0.25] and first.argmax_id == 0 and list(asked.logits) == [0.25]


def test_full_queue_drops_and_counts_without_waiting():
    async def scenario() -> ShadowMonitor:
        mon = monitor(shadow_queue=2)  # no worker started: nothing leaves the queue
        for i in range(5):
            mon.submit(plan(rid=f"q{i}"), captured())
        return mon

    before = dropped("queue_full")
    mon = asyncio.run(scenario())
    assert mon.queue.qsize() == 2 and mon.dropped == 3
    assert dropped("queue_full") - before == 3
    job = mon.queue.get_nowait()
    assert job.prompt == [1, 2, 3, 5, 6] and job.request_id == "q0" and job.capture.argmax == [20, 21, 22]
    # nothing generated or no logits: nothing to compare, nothing queued
    before = dropped("unfinished")
    mon.submit(plan(), ShadowCapture(4, client_logits=False, seam=8))
    assert mon.queue.qsize() == 1 and mon.dropped == 4 and dropped("unfinished") - before == 1


def test_a_sampled_request_that_does_not_complete_is_dropped_once():
    mon = monitor()
    before = dropped("unfinished")
    failed = mon.sample(plan(), req())  # its answer never completed: finish without submit
    mon.finish(failed)
    mon.finish(failed)
    assert mon.dropped == 1 and dropped("unfinished") - before == 1

    async def completed() -> None:
        done = mon.sample(plan(), req())
        done.take(router_pb.TokenEvent(token_id=3, index=0, argmax_id=3, logits=[0.0, 1.0]))
        mon.submit(plan(), done)
        mon.finish(done)  # the request's end after a submit: nothing more to count
    asyncio.run(completed())
    assert mon.queue.qsize() == 1 and mon.dropped == 1 and mon.sampled == 2


def test_busy_or_unreachable_combine_drops_and_counts():
    async def scenario() -> tuple[float, float]:
        pool = CombinePool([closed_address()], channel_options(1 << 20, min_backoff_ms=None), 1.0)
        mon = monitor(pool, shadow_idle_wait_s=0.3)
        try:
            busy, unreachable = dropped("no_idle_combine"), dropped("unavailable")
            pool.items[0].in_flight = 1  # serving one of this router's requests
            t0 = time.monotonic()
            assert await mon.shadow_one(shadow_mod.ShadowJob("j1", 8, [1, 2], captured())) is None
            waited = time.monotonic() - t0
            assert 0.3 <= waited < 1.5, f"waited {waited:.2f} s for an idle combine, not --shadow-idle-wait-s"
            assert dropped("no_idle_combine") - busy == 1
            pool.items[0].in_flight = 0
            assert await mon.shadow_one(shadow_mod.ShadowJob("j2", 8, [1, 2], captured())) is None
            assert pool.items[0].in_flight == 0, "the shadow's hold on the combine is released"
            return dropped("no_idle_combine") - busy, dropped("unavailable") - unreachable
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (1, 1)


def test_records_summary_threshold_log_and_listeners():
    mon = monitor(drift_kl_max=0.1, drift_agreement_min=0.9, drift_window=2)
    heard = []
    mon.listeners.append(lambda out, seam: heard.append((out.request_id, seam, out.over_threshold)))
    mon.listeners.append(lambda out, seam: 1 / 0)  # a broken listener does not stop the records
    results = [("a", 0.01, True, 1.0), ("b", 0.5, False, 0.95), ("c", 0.02, True, 0.5)]
    with structlog.testing.capture_logs() as logs:
        for rid, kl, top1, agreement in results:
            mon.record(rid, 16, combine_pb.ShadowResult(kl=kl, top1_agree=top1, agreement=agreement, steps=4))
    assert heard == [("a", 16, False), ("b", 16, True), ("c", 16, True)]
    over = [e for e in logs if e["event"] == "drift over threshold"]
    assert [(e["request_id"], e["seam"]) for e in over] == [("b", 16), ("c", 16)]
    assert over[0]["kl"] == 0.5 and over[1]["agreement"] == 0.5
    s = mon.summary()
    assert (s.shadowed, s.over_threshold, s.window, s.sample_rate) == (3, 2, 2, 1.0)
    assert s.kl_mean == pytest.approx(0.26) and s.top1_rate == pytest.approx(0.5)
    assert s.agreement_mean == pytest.approx(0.725)
    labels = {"model": MODEL, "seam": "16"}
    assert REGISTRY.get_sample_value("hypic_shadow_over_threshold_total", labels) >= 2
    assert REGISTRY.get_sample_value("hypic_shadow_top1_total", {**labels, "agree": "false"}) >= 1
    assert REGISTRY.get_sample_value("hypic_shadow_kl_count", labels) >= 3


def test_summary_histograms_bucket_every_shadow_as_prometheus_does():
    """Router.Info's histograms put each shadow in the bucket Prometheus would (le: at or under
    the bound), per figure and seam, with the sums; the front adds them up across routers."""
    mon = monitor()
    rng = random.Random()
    kls = [10 ** rng.uniform(-5, 1.5) for _ in range(23)] + [0.01, 1e-4]  # two exactly on a bound
    agreements = [rng.choice([0.5, 0.8, 0.9, 1.0, rng.random()]) for _ in range(len(kls))]
    for i, (kl, agreement) in enumerate(zip(kls, agreements)):
        seam = (8, 32)[i % 2]
        mon.record(f"h{i}", seam, combine_pb.ShadowResult(kl=kl, agreement=agreement, steps=4))
    got = {(h.figure, h.seam): h for h in mon.summary().histograms}
    assert sorted(got) == [("agreement", 8), ("agreement", 32), ("kl", 8), ("kl", 32)]
    for (figure, seam), h in got.items():
        xs = [x for i, x in enumerate(kls if figure == "kl" else agreements) if (8, 32)[i % 2] == seam]
        bounds = list(h.upper_bounds)
        assert bounds == list(shadow_mod.HISTOGRAM_BOUNDS[figure])
        want = [sum(1 for x in xs if lo < x <= hi) for lo, hi in zip([-1.0] + bounds, bounds)]
        want.append(sum(1 for x in xs if x > bounds[-1]))
        assert list(h.counts) == want and sum(h.counts) == len(xs)
        assert h.sum == pytest.approx(sum(xs))
