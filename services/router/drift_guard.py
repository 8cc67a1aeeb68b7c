"""The drift guard: the seam width hypic requests are served with, widened while shadow
recomputes say reuse is moving answers, and narrowed back when they stop saying so.

Levels, narrowest first: --seam, each of --drift-guard-seams, then FULL (hypic requests are served
by full recompute). Shadow results (the KL at the query, top-1 agreement and the teacher-forced
agreement of one request, with the seam it was served with) fill a rolling window of the current
level's results; a result served at another width is from before the last step and is ignored.
Once the window holds enough results, a rolling mean KL over --drift-kl-max or a rolling mean
agreement under --drift-agreement-min steps one level up (the window starts again empty). A level
held for --drift-guard-hold-s whose results (if any) are within both thresholds steps one level
down. At FULL no results arrive (full-recompute answers are not shadowed), so the hold alone
decides: after each hold the guard probes the widest seam again.

The clock is injected (`now`) so that tests drive holds without sleeping. Every step is one log
line and moves the metrics below.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import structlog
from prometheus_client import Counter, Gauge

from services.router.config import RouterConfig

log = structlog.get_logger("router.drift_guard")

# The fewest results a step up is decided on (or the window, when it is smaller): one unlucky
# prompt must not widen every request's seam.
MIN_RESULTS = 8

# Beside the guard rather than in services/router/metrics.py: they describe its state only.
GUARD_SEAM = Gauge("hypic_router_guard_seam",
                   "Seam width the drift guard serves hypic requests with (0 under full fallback)")
GUARD_FULL = Gauge("hypic_router_guard_full",
                   "1 while the drift guard serves hypic requests by full recompute, else 0")
GUARD_STEPS = Counter("hypic_router_guard_steps", "Drift guard steps, up (wider) or down",
                      ["direction"])


@dataclass(frozen=True)
class GuardState:
    """What DriftSummary reports of the guard."""
    enabled: bool
    seam: int    # the seam width hypic requests are served with now (0 under full fallback)
    full: bool   # past the widest seam: hypic requests are served by full recompute


@dataclass(frozen=True)
class _Result:
    kl: float
    top1_agree: bool
    agreement: float


class DriftGuard:
    """One router's guard: `observe` shadow results, `current` the (seam, full) to plan with."""

    def __init__(self, cfg: RouterConfig, now: Callable[[], float] = time.monotonic):
        self.enabled = cfg.drift_guard
        self.seams = [cfg.seam, *cfg.guard_seams]  # level i serves seam seams[i]; len(seams) = FULL
        self.kl_max = cfg.drift_kl_max
        self.agreement_min = cfg.drift_agreement_min
        self.min_results = min(cfg.drift_window, MIN_RESULTS)
        self.hold_s = cfg.drift_guard_hold_s
        self._now = now
        self._lock = threading.Lock()  # observe may come from a shadow worker's thread
        self._window: deque[_Result] = deque(maxlen=cfg.drift_window)
        self._level = 0
        self._since = now()  # when the current level was entered
        self._publish()

    @property
    def full_level(self) -> int:
        return len(self.seams)

    def current(self) -> tuple[int, bool]:
        """(seam, full): the seam width to plan a hypic request with, or (0, True) when it is to be
        served by full recompute. A level held long enough steps down first."""
        with self._lock:
            self._maybe_step_down()
            return self._served()

    def summary(self) -> GuardState:
        """The guard's state for Router.Info (DriftSummary.guard_*)."""
        seam, full = self.current()
        return GuardState(enabled=self.enabled, seam=seam, full=full)

    def observe(self, kl: float, top1_agree: bool, agreement: float, seam: int) -> None:
        """One shadow result of a request served with `seam`; steps up when the window drifts."""
        if not self.enabled:
            return
        with self._lock:
            self._maybe_step_down()
            if self._level == self.full_level or seam != self.seams[self._level]:
                return  # served before the last step: not evidence about this level
            self._window.append(_Result(float(kl), bool(top1_agree), float(agreement)))
            if len(self._window) >= self.min_results and self._drifting():
                self._step(+1)

    # ---- internals (under the lock) ---------------------------------------------------------
    def _served(self) -> tuple[int, bool]:
        if self._level == self.full_level:
            return 0, True
        return self.seams[self._level], False

    def _means(self) -> tuple[float, float, float]:
        """Rolling (mean KL, top-1 rate, mean agreement) of the window (zeros when empty)."""
        n = len(self._window)
        if not n:
            return 0.0, 0.0, 0.0
        return (sum(r.kl for r in self._window) / n, sum(r.top1_agree for r in self._window) / n,
                sum(r.agreement for r in self._window) / n)

    def _drifting(self) -> bool:
        kl, _, agreement = self._means()
        return kl > self.kl_max or agreement < self.agreement_min

    def _maybe_step_down(self) -> None:
        if not self.enabled or self._level == 0:
            return
        if self._now() - self._since < self.hold_s:
            return
        if self._window and self._drifting():
            return  # still drifting here, though not yet on enough results to step up
        self._step(-1)

    def _step(self, direction: int) -> None:
        before = self._served()
        kl, top1, agreement = self._means()
        results = len(self._window)
        self._level += direction
        self._since = self._now()
        self._window.clear()
        after = self._served()
        name = "up" if direction > 0 else "down"
        GUARD_STEPS.labels(name).inc()
        self._publish()
        (log.warning if direction > 0 else log.info)(
            "drift guard step", direction=name, from_level=_level_name(before),
            to_level=_level_name(after), kl_mean=round(kl, 6), top1_rate=round(top1, 4),
            agreement_mean=round(agreement, 4), results=results,
            kl_max=self.kl_max, agreement_min=self.agreement_min)

    def _publish(self) -> None:
        seam, full = self._served()
        GUARD_SEAM.set(seam)
        GUARD_FULL.set(1 if full else 0)


def _level_name(served: tuple[int, bool]) -> str:
    """A level as the log names it: "seam 16", or "full"."""
    seam, full = served
    return "full" if full else f"seam {seam}"
