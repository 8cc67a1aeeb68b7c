"""The drift guard (services/router/drift_guard.py) driven directly, on an injected clock: it steps
up on a drifting window (not on a short one), holds, steps back after the hold when quiet, probes
the widest seam again after a hold at full recompute, ignores stale results of another seam width,
stays fixed when disabled; each step is a log line and moves its metrics."""

from __future__ import annotations

import random

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from services.router.config import RouterConfig
from services.router.drift_guard import MIN_RESULTS, DriftGuard

KL_MAX, AGREE_MIN, HOLD_S = 0.1, 0.9, 60.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_guard(clock: Clock, **kw) -> DriftGuard:
    args = dict(model="m", seam=8, drift_guard_seams="16,32", drift_kl_max=KL_MAX,
                drift_agreement_min=AGREE_MIN, drift_window=32, drift_guard_hold_s=HOLD_S)
    args.update(kw)
    return DriftGuard(RouterConfig(**args), now=clock)


def quiet(rng: random.Random) -> tuple[float, bool, float]:
    """A shadow result well within the thresholds."""
    return rng.uniform(0.0, 0.5 * KL_MAX), True, rng.uniform(0.95, 1.0)


def drifting(rng: random.Random) -> tuple[float, bool, float]:
    """A shadow result over the KL threshold (and under the agreement one)."""
    return rng.uniform(2 * KL_MAX, 10 * KL_MAX), rng.random() < 0.5, rng.uniform(0.0, 0.6)


def feed(guard: DriftGuard, results, n: int, seam: int, rng: random.Random) -> None:
    for _ in range(n):
        guard.observe(*results(rng), seam=seam)


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_steps_up_on_a_drifting_window_not_on_a_short_one(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock)
    assert guard.current() == (8, False)
    feed(guard, drifting, MIN_RESULTS - 1, 8, rng)
    assert guard.current() == (8, False)  # too few results to decide on
    ups = metric("hypic_router_guard_steps_total", direction="up")
    with capture_logs() as logs:
        feed(guard, drifting, 1, 8, rng)
    assert guard.current() == (16, False)
    assert metric("hypic_router_guard_seam") == 16 and metric("hypic_router_guard_full") == 0
    assert metric("hypic_router_guard_steps_total", direction="up") == ups + 1
    [step] = [e for e in logs if e["event"] == "drift guard step"]
    assert step["direction"] == "up" and step["from_level"] == "seam 8" and step["to_level"] == "seam 16"
    assert step["kl_mean"] > KL_MAX and step["agreement_mean"] < AGREE_MIN and step["results"] == MIN_RESULTS
    # The window starts again empty at the new level: one more bad result does not step again.
    feed(guard, drifting, MIN_RESULTS - 1, 16, rng)
    assert guard.current() == (16, False)


@pytest.mark.parametrize("kl,agreement", [(0.2, 1.0), (0.0, 0.5)])
def test_either_threshold_alone_steps_up_and_a_quiet_window_does_not(kl, agreement, fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock)
    feed(guard, quiet, 40, 8, rng)  # a full window of quiet results, more than once over
    assert guard.current() == (8, False)
    for _ in range(64):  # the rolling mean crosses once enough bad results are in the window
        guard.observe(kl, True, agreement, seam=8)
        if guard.current() != (8, False):
            break
    assert guard.current() == (16, False)


def test_a_small_window_decides_on_fewer_results() -> None:
    guard = make_guard(Clock(), drift_window=3)
    for _ in range(3):
        guard.observe(1.0, False, 0.0, seam=8)
    assert guard.current() == (16, False)


def test_holds_then_steps_back_when_quiet_but_not_while_drifting(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock)
    feed(guard, drifting, MIN_RESULTS, 8, rng)
    assert guard.current() == (16, False)
    clock.t += HOLD_S - 1
    feed(guard, quiet, 3, 16, rng)
    assert guard.current() == (16, False)  # held
    clock.t += 1
    downs = metric("hypic_router_guard_steps_total", direction="down")
    with capture_logs() as logs:
        assert guard.current() == (8, False)  # held long enough, quiet there: back one level
    assert metric("hypic_router_guard_steps_total", direction="down") == downs + 1
    [step] = [e for e in logs if e["event"] == "drift guard step"]
    assert step["direction"] == "down" and step["from_level"] == "seam 16" and step["to_level"] == "seam 8"
    # At 16 again, drifting but on too few results to step up: the hold does not step it back.
    feed(guard, drifting, MIN_RESULTS, 8, rng)
    feed(guard, drifting, 2, 16, rng)
    clock.t += 10 * HOLD_S
    assert guard.current() == (16, False)


def test_full_fallback_past_the_widest_then_a_probe_after_each_hold(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock)
    for seam in (8, 16, 32):
        feed(guard, drifting, MIN_RESULTS, seam, rng)
    assert guard.current() == (0, True)
    assert metric("hypic_router_guard_full") == 1 and metric("hypic_router_guard_seam") == 0
    s = guard.summary()
    assert s.enabled and s.full and s.seam == 0
    # Results still arriving from requests served at 32 (stale) change nothing at full.
    feed(guard, drifting, 3 * MIN_RESULTS, 32, rng)
    clock.t += HOLD_S - 1
    assert guard.current() == (0, True)
    clock.t += 1
    assert guard.current() == (32, False)  # the hold alone decides: probe the widest seam
    assert metric("hypic_router_guard_full") == 0 and metric("hypic_router_guard_seam") == 32
    feed(guard, drifting, MIN_RESULTS, 32, rng)  # still drifting there: back to full
    assert guard.current() == (0, True)
    clock.t += HOLD_S
    assert guard.current() == (32, False)
    feed(guard, quiet, MIN_RESULTS, 32, rng)  # quiet now: down level by level, one per hold
    for seam in (16, 8):
        clock.t += HOLD_S
        assert guard.current() == (seam, False)
    clock.t += 10 * HOLD_S
    assert guard.current() == (8, False)  # never below --seam


def test_results_of_another_seam_width_are_ignored(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock)
    feed(guard, drifting, 5 * MIN_RESULTS, 16, rng)  # no request is served at 16 yet
    feed(guard, drifting, 5 * MIN_RESULTS, 0, rng)
    assert guard.current() == (8, False)
    feed(guard, drifting, MIN_RESULTS, 8, rng)
    assert guard.current() == (16, False)
    # Shadows of requests served at 8 before the step come in late: not evidence about 16.
    feed(guard, drifting, 5 * MIN_RESULTS, 8, rng)
    assert guard.current() == (16, False)
    # ... nor do they keep 16 from stepping back once it was held quietly.
    clock.t += HOLD_S
    assert guard.current() == (8, False)


def test_disabled_guard_stays_at_the_configured_seam(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock, drift_guard=False, seam=4)
    for seam in (4, 16, 32):
        feed(guard, drifting, 4 * MIN_RESULTS, seam, rng)
    clock.t += 10 * HOLD_S
    assert guard.current() == (4, False)
    s = guard.summary()
    assert not s.enabled and s.seam == 4 and not s.full


def test_no_wider_seams_goes_from_the_seam_straight_to_full(fresh_seed) -> None:
    rng, clock = random.Random(fresh_seed), Clock()
    guard = make_guard(clock, drift_guard_seams="")
    feed(guard, drifting, MIN_RESULTS, 8, rng)
    assert guard.current() == (0, True)
    clock.t += HOLD_S
    assert guard.current() == (8, False)
