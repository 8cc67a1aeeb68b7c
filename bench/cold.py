"""Cold path (docs/design.md §4): cold TTFT with 1 vs m scatter workers, and LPT vs naive partitioning.

Measured (on the running mesh, driven by bench/serve.py): cold requests of fresh documents never
seen before (skewed segment lengths), on m = 2 scatter workers, then on m = 1 (scatter1 stopped:
the router's planner marks it down and sends every miss to scatter0). Full recompute of the same
prompts is measured alongside.

Simulated (labelled as such everywhere): TTFT of a 32k-token request of skewed segment lengths on
m = 1, 2, 4, 8 workers, for three partitionings of its misses:
- lpt: the router's own `services.router.planner.Planner` (LPT over the CostModel's estimates),
- round_robin: segment i -> worker i mod m,
- contiguous: the segment list cut into m consecutive runs of (nearly) equal segment count.
Per-segment build costs come from a `services.router.planner.CostModel` fitted on the measured
`trace.build_s` of the cold builds (t = a + b·L + c·L²); each worker builds its segments one after
the other in request order (as a scatter worker does) on a core of its own; the combine composes
segment i when it and all before it have arrived, at the measured per-segment compose cost
(seam recompute + body append), then prefills the query; the fixed overhead (router, lookup,
transfers) is calibrated so the simulation matches the measured m = 1 cold TTFT, and the measured
m = 2 TTFT is reported next to the simulated one as a check.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

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


def simulate(lengths: Sequence[int], m: int, how: str, cost: CostModel,
             compose_s: Callable[[int], float], query_s: float, overhead_s: float = 0.0) -> SimResult:
    """Cold TTFT of one request whose segments are all misses (see the module docstring)."""
    workers = partition(lengths, m, how, cost)
    t_free = [0.0] * m
    arrival = [0.0] * len(lengths)
    for i, (L, w) in enumerate(zip(lengths, workers)):  # each worker in request order
        t_free[w] += cost.predict(L)
        arrival[i] = t_free[w]
    t = 0.0
    for i, L in enumerate(lengths):  # combine: in order, as soon as segment i and all before it are in
        t = max(t, arrival[i]) + compose_s(L)
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


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def plot(cold: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    meas = cold["measured"]
    labels = ["full recompute", "hypic cold m=1", "hypic cold m=2"]
    vals = [meas["full_ttft_s"], meas["m1_ttft_s"], meas["m2_ttft_s"]]
    a0.bar(labels, vals, color=["#888888", "#1f77b4", "#2ca02c"])
    for x, v in enumerate(vals):
        a0.text(x, v, f"{v:.2f} s", ha="center", va="bottom")
    a0.set_ylabel("TTFT (s, median)")
    a0.set_title(f"measured: cold {meas['prompt_tokens']}-token request, {meas['segments']} segments")
    sim = cold["simulated"]
    for how, mk in zip(PARTITIONS, "osv"):
        rows = [r for r in sim["rows"] if r["partition"] == how]
        a1.plot([r["m"] for r in rows], [r["speedup_vs_m1"] for r in rows], marker=mk, label=how)
    ms = sorted({r["m"] for r in sim["rows"]})
    a1.plot(ms, ms, ls=":", color="grey", label="linear")
    a1.set_xscale("log", base=2)
    a1.set_xticks(ms, [str(m) for m in ms])
    a1.set_xlabel("scatter workers m")
    a1.set_ylabel("cold TTFT speedup vs m = 1")
    a1.set_title(f"SIMULATED: {sim['prompt_tokens']}-token request, {len(sim['lengths'])} segments")
    a1.legend()
    a1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
