"""The cold path's model (docs/design.md §4): per-segment build costs fitted with the router's
CostModel, the arrival of each entry on m scatter workers under three partitionings, the combine
in order or in arrived runs, and the TTFT a request gets — computed from costs, no model run.

Partitionings of a request's misses:
- lpt: the router's own `services.router.planner.Planner` (LPT over the CostModel's estimates),
- round_robin: segment i -> worker i mod m,
- contiguous: the segment list cut into m consecutive runs of (nearly) equal segment count.
Build costs: t = a + b·L + c·L² fitted on measured builds; each worker builds its segments one
after the other in request order (as a scatter worker does) on a core of its own. `reprice`
recomputes a replay's TTFTs (bench.cold) for another fixed overhead from its JSON alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from services.router.planner import CostModel, Job, Planner

PARTITIONS = ("lpt", "round_robin", "contiguous")


def fit_cost_model(builds: Sequence[tuple[int, float]]) -> CostModel:
    """The router's CostModel fitted on measured (tokens, build_s) pairs."""
    cm = CostModel()
    for tokens, secs in builds:
        cm.observe(tokens, secs)
    return cm


def partition(lengths: Sequence[int], m: int, how: str, cost: CostModel) -> list[int]:
    """Worker of each segment."""
    n = len(lengths)
    if how == "lpt":
        planner = Planner(m, cost)
        ticket = planner.assign([Job(i, f"seg{i}", int(L)) for i, L in enumerate(lengths)])
        workers = [a.worker for a in ticket.assignments]
        planner.release(ticket)
        return workers
    if how == "round_robin":
        return [i % m for i in range(n)]
    if how == "contiguous":
        # m consecutive runs whose sizes differ by at most one segment
        base, extra = divmod(n, m)
        out = []
        for w in range(m):
            out += [w] * (base + (1 if w < extra else 0))
        return out
    raise ValueError(f"unknown partitioning {how!r}")


@dataclass
class SimResult:
    m: int
    partition: str
    ttft_s: float
    makespan_s: float          # when the last build is done
    worker_busy_s: list[float]

    def as_dict(self) -> dict:
        return dict(m=self.m, partition=self.partition, ttft_s=self.ttft_s, makespan_s=self.makespan_s,
                    worker_busy_s=self.worker_busy_s,
                    imbalance=max(self.worker_busy_s) / (sum(self.worker_busy_s) / len(self.worker_busy_s))
                    if sum(self.worker_busy_s) > 0 else 1.0)


def arrivals(lengths: Sequence[int], m: int, how: str, cost: CostModel) -> tuple[list[float], list[float]]:
    """(arrival time of each segment's entry, busy time of each worker): each worker builds its
    segments one after the other in request order, as a scatter worker does."""
    workers = partition(lengths, m, how, cost)
    t_free = [0.0] * m
    arrival = [0.0] * len(lengths)
    for i, (L, w) in enumerate(zip(lengths, workers)):
        t_free[w] += cost.predict(L)
        arrival[i] = t_free[w]
    return arrival, t_free


def combine_in_order(lengths: Sequence[int], arrival: Sequence[float], compose_s: Callable[[int], float]) -> float:
    """When the combine is done: segment i composed as soon as it and all before it are in."""
    t = 0.0
    for i, L in enumerate(lengths):
        t = max(t, arrival[i]) + compose_s(L)
    return t


def combine_in_runs(arrival: Sequence[float], run_s: Callable[[range], float]) -> tuple[float, list[int]]:
    """(when the combine is done, segments per pass): whenever it is free, the run of consecutive
    segments already in from the next one, in one pass costing run_s(run) (services/combine)."""
    t, nxt, n, runs = 0.0, 0, len(arrival), []
    while nxt < n:
        t = max(t, arrival[nxt])
        end = nxt
        while end < n and arrival[end] <= t:
            end += 1
        t += run_s(range(nxt, end))
        runs.append(end - nxt)
        nxt = end
    return t, runs


def simulate(lengths: Sequence[int], m: int, how: str, cost: CostModel,
             compose_s: Callable[[int], float], query_s: float, overhead_s: float = 0.0,
             run_s: Callable[[range], float] | None = None) -> SimResult:
    """Cold TTFT of one request whose segments are all misses (see the module docstring): the
    combine in order (compose_s per segment) or, given run_s, in arrived runs."""
    arrival, t_free = arrivals(lengths, m, how, cost)
    if run_s is None:
        t = combine_in_order(lengths, arrival, compose_s)
    else:
        t, _ = combine_in_runs(arrival, run_s)
    return SimResult(m, how, overhead_s + t + query_s, max(arrival) if arrival else 0.0, t_free)


def simulate_table(lengths: Sequence[int], ms: Sequence[int], cost: CostModel,
                   compose_s: Callable[[int], float], query_s: float, overhead_s: float) -> list[dict]:
    rows = []
    base = simulate(lengths, 1, "lpt", cost, compose_s, query_s, overhead_s)
    for how in PARTITIONS:
        for m in ms:
            r = simulate(lengths, m, how, cost, compose_s, query_s, overhead_s).as_dict()
            r["speedup_vs_m1"] = base.ttft_s / r["ttft_s"]
            r["makespan_speedup_vs_m1"] = base.makespan_s / r["makespan_s"] if r["makespan_s"] else math.nan
            rows.append(r)
    return rows


OVERHEAD_NOTE = ("router, lookup and transfers: a fixed overhead calibrated on a mesh's measured m = 1 cold TTFT "
                 "(overhead_source says which); *_compute_only fields leave it out")


def add_ttft(rows: list[dict], query_s: float, overhead_s: float) -> None:
    """Per replayed row: TTFT = overhead + combine done + query; its speedup over m = 1 (LPT) of the
    same policy and of in_order; and the bound a combine costing nothing would reach (overhead +
    last arrival + query) with its speedup over arrived runs at m = 1. With and without the overhead."""
    m1 = {r["policy"]: r["combine_done_s"] for r in rows if r["partition"] == "lpt" and r["m"] == 1}
    for r in rows:
        for tag, ov in (("", overhead_s), ("_compute_only", 0.0)):
            r[f"ttft{tag}_s"] = ov + r["combine_done_s"] + query_s
            r[f"speedup_vs_m1{tag}"] = (ov + m1[r["policy"]] + query_s) / r[f"ttft{tag}_s"]
            r[f"speedup_vs_in_order_m1{tag}"] = (ov + m1["in_order"] + query_s) / r[f"ttft{tag}_s"]
            r[f"ttft_zero_cost_combine{tag}_s"] = ov + r["makespan_s"] + query_s
            r[f"speedup_zero_cost_combine{tag}"] = (ov + m1["runs"] + query_s) / r[f"ttft_zero_cost_combine{tag}_s"]


def fitted_table(lengths: Sequence[int], ms: Sequence[int], cost: CostModel, fit: dict[str, float],
                 query_s: float, overhead_s: float) -> list[dict]:
    """The replay's table from the fitted build and pass costs alone (the old simulation's form)."""
    run_s = run_cost(fit, lengths)
    t1 = simulate(lengths, 1, "lpt", cost, lambda L: 0.0, query_s, overhead_s, run_s=run_s).ttft_s
    mk1 = max(arrivals(lengths, 1, "lpt", cost)[0])
    rows = []
    for how in PARTITIONS:
        for m in ms:
            r = simulate(lengths, m, how, cost, lambda L: 0.0, query_s, overhead_s, run_s=run_s)
            rows.append(dict(r.as_dict(), speedup_vs_m1=t1 / r.ttft_s, makespan_speedup_vs_m1=mk1 / r.makespan_s))
    return rows


def reprice(res: dict, overhead_s: float, overhead_source: str) -> dict:
    """`res` (a measure() result) for another fixed overhead, exactly: the replayed passes are kept,
    the TTFTs, speedups and the fitted table are recomputed from the JSON alone (no model run)."""
    cost = fit_cost_model([tuple(o) for o in res["cost_model"]["observations"]])
    fit = {k: res["run_cost_fit"][k] for k in RUN_FEATURES}
    ms = sorted({r["m"] for r in res["rows"]})
    add_ttft(res["rows"], res["query_s"], overhead_s)
    res["simulated_from_fits"]["rows"] = fitted_table(res["lengths"], ms, cost, fit, res["query_s"], overhead_s)
    res.update(overhead_s=overhead_s, overhead_note=OVERHEAD_NOTE, overhead_source=overhead_source,
               longest_segment_tokens=max(res["lengths"]), longest_build_s=cost.predict(max(res["lengths"])))
    return res


RUN_FEATURES = ("pass_s", "per_seam_s", "per_seam_per_1k_keys_s", "per_1k_run_tokens_s")


def _run_features(k: int, prefix: int, run_tokens: int) -> list[float]:
    # a pass; each seam (fixed work: its tokens through every layer); each seam's attention over
    # the keys before it (~ prefix + half the run); the run's bodies (keys laid out, states composed)
    return [1.0, float(k), k * (prefix + run_tokens / 2) / 1000.0, run_tokens / 1000.0]


def fit_run_cost(passes: Sequence[dict]) -> dict[str, float]:
    """Least squares fit, coefficients >= 0 (a negative one is dropped and the rest refitted),
    of a pass's measured seconds on _run_features. Minimises relative error (weights 1/t)."""
    X = np.array([_run_features(p["segments"], p["prefix_tokens"], p["run_tokens"]) for p in passes])
    y = np.array([p["seconds"] for p in passes])
    w = 1.0 / np.maximum(y, 1e-6)
    keep = list(range(X.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(X[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = [0.0] * X.shape[1]
    for j, c in zip(keep, coef):
        full[j] = max(float(c), 0.0)
    return dict(zip(RUN_FEATURES, full))


def run_cost(fit: dict[str, float], lengths: Sequence[int]) -> Callable[[range], float]:
    """run_s for `simulate` from a fit_run_cost fit (prefix tokens from the lengths before)."""
    starts = [0]
    for L in lengths:
        starts.append(starts[-1] + L)
    coef = [fit[k] for k in RUN_FEATURES]

    def run_s(run: range) -> float:
        x = _run_features(len(run), starts[run.start], starts[run.stop] - starts[run.start])
        return sum(c * v for c, v in zip(coef, x))
    return run_s
