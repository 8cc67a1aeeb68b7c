"""Miss placement for the router (docs/design.md §4): an online cost model and a load-aware LPT planner.

Pure Python (numpy for a 3×3 solve); no gRPC, no asyncio, no locks: the router calls it from its
event loop only.

    planner = Planner(n_workers=4)
    ticket = planner.assign([Job(index=0, key=k0, tokens=900), Job(index=3, key=k3, tokens=120)])
    for a in ticket.assignments: ...              # a.worker, a.est_s, a.shared
    planner.complete(ticket, k0, tokens=900, build_s=0.41)   # a SegmentReady for k0 arrived
    planner.release(ticket)                       # the request ended (whatever happened)

CostModel: t(L) = a + b·L + c·L², fitted by non-negative least squares over the last few
hundred (tokens, build_s) pairs of SegmentReady events, in relative error (short and long builds
count alike), with the prior's shape filling in where no data lies (and before any arrives).

LPT: misses sorted by estimated cost, longest first, each given to the worker with the least
(outstanding load + what this plan already gave it). Outstanding load is what the router itself
dispatched and has not seen completed (optionally raised to what `Scatter.Load` reports).
Single flight: a key already being built for another in-flight request goes to the same worker
and adds no load (the scatter service shares the build).
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

# Prior of the build cost of one segment alone: ~20 ms fixed + 0.2 ms/token + a mild quadratic
# (attention) term. The right order for a small model on CPU; the online fit replaces it.
DEFAULT_PRIOR = (0.02, 2e-4, 2e-9)


class CostModel:
    """Online non-negative least squares fit of t = a + b·L + c·L² (seconds, L in tokens).

    The last `window` builds are kept. The fit minimises relative error (weights 1/t̂², two
    reweighting passes), so short and long builds count alike. The prior contributes its shape
    only: pseudo-observations at `prior_lengths` lie on the prior curve rescaled to this
    machine's speed (the median of observed / prior), with a small total weight, so one
    observed length already moves the whole curve and rich data overrides the shape.
    """

    def __init__(self, prior: Sequence[float] = DEFAULT_PRIOR, *, scale: float = 1024.0,
                 prior_weight: float = 0.5, prior_lengths: Sequence[int] = (64, 1024, 8192),
                 window: int = 512, floor_s: float = 1e-4):
        if len(prior) != 3 or any(not math.isfinite(p) or p < 0 for p in prior) or not any(prior):
            raise ValueError(f"prior must be three finite numbers >= 0, not all 0; got {prior!r}")
        self.prior = tuple(float(p) for p in prior)
        self.scale = float(scale)
        self.prior_weight = float(prior_weight)
        self.prior_lengths = [float(L) for L in prior_lengths]
        self.floor_s = float(floor_s)
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)
        self.n = 0  # observations taken (all time)
        self._theta = self._to_scaled(self.prior)
        self._dirty = False

    # -- features (L scaled so the normal equations stay well conditioned) ---------------------
    def _phi(self, tokens: Any) -> np.ndarray:
        x = np.asarray(tokens, dtype=float) / self.scale
        return np.stack([np.ones_like(x), x, x * x], axis=-1)

    def _prior_at(self, tokens: float) -> float:
        a, b, c = self.prior
        return max(a + b * tokens + c * tokens * tokens, self.floor_s)

    def _to_scaled(self, coef: Sequence[float]) -> np.ndarray:
        return np.array([coef[0], coef[1] * self.scale, coef[2] * self.scale ** 2])

    # -- API ---------------------------------------------------------------------------------
    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a [s], b [s/token], c [s/token²]) of the current fit."""
        th = self._fit()
        return float(th[0]), float(th[1] / self.scale), float(th[2] / self.scale ** 2)

    def predict(self, tokens: float) -> float:
        """Estimated seconds to build one segment of `tokens` tokens alone."""
        if tokens <= 0:
            return 0.0
        return max(self.floor_s, float(self._phi(tokens) @ self._fit()))

    def observe(self, tokens: float, seconds: float) -> bool:
        """Add one measured build; returns False (ignored) for unusable numbers."""
        if not (tokens > 0 and math.isfinite(tokens) and seconds > 0 and math.isfinite(seconds)):
            return False
        self._obs.append((float(tokens), float(seconds)))
        self.n += 1
        self._dirty = True
        return True

    # -- fitting -----------------------------------------------------------------------------
    def _fit(self) -> np.ndarray:
        if self._dirty:
            self._theta = self._solve()
            self._dirty = False
        return self._theta

    def _solve(self) -> np.ndarray:
        L = np.array([o[0] for o in self._obs])
        t = np.array([o[1] for o in self._obs])
        prior_t = np.array([self._prior_at(x) for x in L])
        speed = float(np.median(t / prior_t))            # this machine vs the prior curve
        PL = np.array(self.prior_lengths)
        Pt = speed * np.array([self._prior_at(x) for x in PL])
        X = np.concatenate([self._phi(L), self._phi(PL)])
        y = np.concatenate([t, Pt])
        base = np.concatenate([np.ones(len(L)), np.full(len(PL), self.prior_weight)])
        scale_t = y.copy()
        theta = self._to_scaled(self.prior) * speed
        for _ in range(2):  # reweight by the current fit (relative errors)
            w = base / np.maximum(scale_t, self.floor_s) ** 2
            A = (X * w[:, None]).T @ X
            b = (X * w[:, None]).T @ y
            theta = _nnls3(A, b, fallback=theta)
            scale_t = np.maximum(X @ theta, self.floor_s)
        return theta


def _nnls3(A: np.ndarray, b: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """argmin over θ ≥ 0 of θᵀAθ − 2θᵀb, by trying every active set (3 unknowns: 7 sets)."""
    best, best_obj = None, math.inf
    for r in (3, 2, 1):
        for idx in itertools.combinations(range(3), r):
            sub = np.ix_(idx, idx)
            try:
                th_s = np.linalg.solve(A[sub], b[list(idx)])
            except np.linalg.LinAlgError:
                continue
            if np.any(th_s < 0) or not np.all(np.isfinite(th_s)):
                continue
            th = np.zeros(3)
            th[list(idx)] = th_s
            obj = float(th @ A @ th - 2 * th @ b)
            if obj < best_obj:
                best, best_obj = th, obj
    return best if best is not None else fallback
# ---- pure scheduling helpers (also the baselines the tests compare against) -----------------

def lpt(costs: Sequence[float], n_workers: int, initial: Sequence[float] | None = None) -> list[int]:
    """Longest processing time first: worker index per job."""
    if n_workers <= 0:
        raise ValueError("n_workers must be > 0")
    load = list(initial) if initial is not None else [0.0] * n_workers
    out = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        w = min(range(n_workers), key=lambda w: (load[w], w))
        out[j] = w
        load[w] += costs[j]
    return out


def round_robin(costs: Sequence[float], n_workers: int) -> list[int]:
    return [j % n_workers for j in range(len(costs))]


def contiguous(costs: Sequence[float], n_workers: int) -> list[int]:
    """Segments in prompt order cut into n_workers runs of (nearly) equal count."""
    n = len(costs)
    return [min(n_workers - 1, j * n_workers // max(n, 1)) for j in range(n)]


def makespan(costs: Sequence[float], placement: Sequence[int], n_workers: int,
             initial: Sequence[float] | None = None) -> float:
    load = list(initial) if initial is not None else [0.0] * n_workers
    for c, w in zip(costs, placement):
        load[w] += c
    return max(load) if load else 0.0


# ---- the stateful planner -------------------------------------------------------------------

@dataclass
class Job:
    index: int        # position of the segment in the request
    key: str
    tokens: int


@dataclass
class Assignment:
    index: int
    key: str
    tokens: int
    worker: int
    est_s: float
    shared: bool      # joins a build already in flight (another request, or a duplicate here)


@dataclass(eq=False)
class _Flight:
    key: str
    worker: int
    est_s: float
    tokens: int
    refs: int = 0


@dataclass(eq=False)
class Ticket:
    """One request's share of the planner's state; give it back with Planner.release()."""
    assignments: list[Assignment] = field(default_factory=list)
    _flights: dict[str, _Flight] = field(default_factory=dict)   # unresolved, by key
    released: bool = False

    @property
    def keys(self) -> list[str]:
        return list(self._flights)


class Planner:
    def __init__(self, n_workers: int, cost_model: CostModel | None = None):
        if n_workers < 0:
            raise ValueError("n_workers must be >= 0")
        self.n_workers = n_workers
        self.cost = cost_model or CostModel()
        self._own = [0.0] * n_workers          # estimated seconds dispatched and not completed
        self._count = [0] * n_workers          # flights per worker (to zero _own exactly)
        self._external = [0.0] * n_workers     # from Scatter.Load polls
        self._down: set[int] = set()
        self._absent: set[int] = set()         # left the member set (discovery)
        self._inflight: dict[str, _Flight] = {}

    # -- load views ------------------------------------------------------------------------
    def load(self, worker: int) -> float:
        """Estimated seconds of work queued on `worker`."""
        return max(self._own[worker], self._external[worker])

    def loads(self) -> list[float]:
        return [self.load(w) for w in range(self.n_workers)]

    def outstanding(self, worker: int) -> float:
        return self._own[worker]

    def inflight_keys(self) -> dict[str, int]:
        return {k: f.worker for k, f in self._inflight.items()}

    def set_external_load(self, worker: int, in_flight: int, queued_tokens: float) -> None:
        """What the worker itself reports (Scatter.Load): builds queued and their tokens."""
        if in_flight <= 0 or queued_tokens <= 0:
            self._external[worker] = 0.0
        else:
            self._external[worker] = in_flight * self.cost.predict(queued_tokens / in_flight)

    def mark_down(self, worker: int, down: bool = True) -> None:
        (self._down.add if down else self._down.discard)(worker)

    def is_down(self, worker: int) -> bool:
        return worker in self._down

    def add_worker(self) -> int:
        """A new member (discovery): its index, with no load."""
        self._own.append(0.0)
        self._count.append(0)
        self._external.append(0.0)
        self.n_workers += 1
        return self.n_workers - 1

    def set_absent(self, worker: int, absent: bool = True) -> None:
        """A worker that left the member set is never assigned (its index stays: plans in
        flight still name it). A returning member clears its old load readings."""
        if absent:
            self._absent.add(worker)
        elif worker in self._absent:
            self._absent.discard(worker)
            self._external[worker] = 0.0
            self._down.discard(worker)

    def is_absent(self, worker: int) -> bool:
        return worker in self._absent

    def idle(self, worker: int) -> bool:
        """No build of ours is outstanding on it (its index may be reused)."""
        return self._count[worker] == 0

    def up_workers(self) -> list[int]:
        """Present workers that answer; all present ones if none answers (combine falls back
        to building locally when a worker really is gone); [] when there is no member."""
        present = [w for w in range(self.n_workers) if w not in self._absent]
        up = [w for w in present if w not in self._down]
        return up or present

    # -- planning ------------------------------------------------------------------------------
    def assign(self, jobs: Iterable[Job]) -> Ticket:
        """Place misses; registers their load and in-flight keys under the returned ticket."""
        jobs = list(jobs)
        ticket = Ticket()
        if not jobs:
            return ticket
        up = self.up_workers()
        if not up:
            raise ValueError("no scatter workers to assign to")
        by_index: dict[int, Assignment] = {}
        new: list[Job] = []
        seen_new: dict[str, list[Job]] = {}
        for job in jobs:
            flight = self._inflight.get(job.key)
            if flight is not None:
                self._join(ticket, flight)
                by_index[job.index] = Assignment(job.index, job.key, job.tokens, flight.worker,
                                                 flight.est_s, True)
            elif job.key in seen_new:
                seen_new[job.key].append(job)          # duplicate within this request
            else:
                seen_new[job.key] = [job]
                new.append(job)
        est = {job.key: self.cost.predict(job.tokens) for job in new}
        for job in sorted(new, key=lambda j: (-est[j.key], j.index)):
            w = min(up, key=lambda w: (self.load(w), self._count[w], w))
            flight = _Flight(job.key, w, est[job.key], job.tokens)
            self._inflight[job.key] = flight
            self._own[w] += flight.est_s
            self._count[w] += 1
            self._join(ticket, flight)
            for k, dup in enumerate(seen_new[job.key]):
                by_index[dup.index] = Assignment(dup.index, dup.key, dup.tokens, w, flight.est_s, k > 0)
        ticket.assignments = [by_index[j.index] for j in jobs]
        return ticket

    def _join(self, ticket: Ticket, flight: _Flight) -> None:
        if flight.key not in ticket._flights:
            flight.refs += 1
            ticket._flights[flight.key] = flight

    def _retire(self, flight: _Flight) -> None:
        """The build is over (done or abandoned): its load leaves the worker."""
        if self._inflight.get(flight.key) is not flight:
            return
        del self._inflight[flight.key]
        w = flight.worker
        self._count[w] -= 1
        self._own[w] = 0.0 if self._count[w] <= 0 else max(0.0, self._own[w] - flight.est_s)
        self._count[w] = max(0, self._count[w])

    def complete(self, ticket: Ticket, key: str, *, tokens: int = 0, build_s: float = 0.0) -> bool:
        """A SegmentReady for `key` arrived on this ticket's request. The first report of a build
        retires its load and feeds the cost model (later reports of the same shared build do
        not). Returns True when the cost model took the observation."""
        flight = ticket._flights.pop(key, None)
        if flight is None:
            return False
        live = self._inflight.get(key) is flight
        self._retire(flight)
        if live and build_s > 0:
            return self.cost.observe(tokens or flight.tokens, build_s)
        return False

    def release(self, ticket: Ticket) -> None:
        """The request is over: drop its references; builds nobody waits for any more leave the
        load (their worker may still finish them; the scatter service shares or drops them)."""
        if ticket.released:
            return
        ticket.released = True
        for flight in ticket._flights.values():
            flight.refs -= 1
            if flight.refs <= 0:
                self._retire(flight)
        ticket._flights.clear()
