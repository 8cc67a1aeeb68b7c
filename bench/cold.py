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

Measured replay (`python -m bench.cold`, bench/results/cold_runs.json): the same 32k-token request
on one process, one torch thread. Every segment's entry is really built (its build time is the
observation the CostModel is fitted on); the arrival times of the builds on m workers come from
that fitted model (m workers cannot run side by side on this machine); the combine is REPLAYED on
a virtual clock with the real engine: each composition really runs and advances the clock by its
measured time. Two combine policies on the same arrivals:
- in_order: segment i composed once it and all before it are in (compose_segment), the old path;
- runs: whenever the combine is free, the run of consecutive arrived segments from the next one
  in one layer-major pass (compose_run), what services/combine does now.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

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


# ---- measured replay (python -m bench.cold) ----------------------------------------------------

POLICIES = ("in_order", "runs")


class Replay:
    """The combine's compositions of one request, really run on `engine` on a virtual clock."""

    def __init__(self, engine, entries):
        self.engine, self.entries = engine, entries
        self.passes: list[dict] = []  # per pass: segments, prefix tokens, run tokens, seconds

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def run(self, arrival: Sequence[float], policy: str) -> tuple[float, list[int], Any]:
        """(when the combine is done, segments per pass, the composed state)."""
        from common.engine.pic.reuse import compose_run, compose_segment

        eng, entries = self.engine, self.entries
        capacity = sum(e.n_tokens for e in entries)  # keys into one arena per layer, as combine does
        state = eng.new_state()
        self.passes = []

        def run_s(run: range) -> float:
            nonlocal state
            prefix = state.seq_len
            if policy == "in_order":
                state, secs = self._timed(compose_segment, eng, state, entries[run.start])
            else:
                state, secs = self._timed(compose_run, eng, state, [entries[j] for j in run], capacity)
            self.passes.append(dict(segments=len(run), prefix_tokens=prefix,
                                    run_tokens=sum(entries[j].n_tokens for j in run), seconds=secs))
            return secs

        if policy == "in_order":  # one pass per segment, in prompt order
            t = 0.0
            for i in range(len(entries)):
                t = max(t, arrival[i]) + run_s(range(i, i + 1))
            runs = [1] * len(entries)
        elif policy == "runs":
            t, runs = combine_in_runs(arrival, run_s)
        else:
            raise ValueError(f"unknown policy {policy!r}")
        return t, runs, state


def measure(model: Path, tokens: int, seed: int, ms: Sequence[int], seam: int, overhead_s: float,
            query_len: int = 4, reps: int = 2, overhead_source: str = "--overhead-s") -> dict:
    """Builds measured and fitted, combine replayed per policy, m and partitioning (module docstring)."""
    import random

    import torch

    from bench.workloads import skewed_lengths
    from common.engine.hybrid_engine import HybridEngine
    from common.engine.pic.build import build_entry

    torch.set_num_threads(1)
    engine = HybridEngine.from_pretrained(model)
    lengths = skewed_lengths(tokens, seed=seed * 1000 + 8, lo=128, hi=4096)
    rng = random.Random(seed)
    segs = [[rng.randrange(engine.vocab_size) for _ in range(L)] for L in lengths]
    query = [rng.randrange(engine.vocab_size) for _ in range(query_len)]
    build_entry(engine, segs[0][:64], seam)  # warm-up
    entries = []
    build_s = [math.inf] * len(segs)

    def time_builds() -> None:  # each build: the faster of two passes (the machine is shared)
        for i, s in enumerate(segs):
            t0 = time.perf_counter()
            e = build_entry(engine, s, seam)
            build_s[i] = min(build_s[i], time.perf_counter() - t0)
            if len(entries) < len(segs):
                entries.append(e)

    time_builds()
    time_builds()
    builds = list(zip(lengths, build_s))
    cost = fit_cost_model(builds)
    rep = Replay(engine, entries)
    rows, passes, query_s = [], {}, []
    for policy in POLICIES:
        for how in PARTITIONS:
            for m in ms:
                arrival, t_free = arrivals(lengths, m, how, cost)
                trials = []
                for _ in range(reps):  # the machine is shared: the faster of `reps` replays
                    done, runs, state = rep.run(arrival, policy)
                    trials.append((done, runs, list(rep.passes)))
                done, runs, ps = min(trials, key=lambda x: x[0])
                passes[f"{policy}/{how}/{m}"] = ps
                rows.append(dict(policy=policy, partition=how, m=m, combine_done_s=done, runs=runs,
                                 makespan_s=max(arrival), worker_busy_s=t_free,
                                 compose_total_s=sum(p["seconds"] for p in ps),
                                 tail_after_last_arrival_s=done - max(arrival)))
        for _ in range(3):
            t0 = time.perf_counter()
            engine.forward(query, state)
            query_s.append(time.perf_counter() - t0)
    q = min(query_s)
    add_ttft(rows, q, overhead_s)
    all_passes = [p for key, ps in passes.items() if key.startswith("runs/") for p in ps]
    fit = fit_run_cost(all_passes)
    fitted = fitted_table(lengths, ms, cost, fit, q, overhead_s)
    a, b, c = cost.coefficients
    return dict(
        run_cost_fit=dict(fit, form="pass_s + per_seam_s*k + per_seam_per_1k_keys_s*k*(prefix + run/2)/1000 "
                                    "+ per_1k_run_tokens_s*run/1000", passes=len(all_passes)),
        simulated_from_fits=dict(label="SIMULATED from the fitted build and run costs alone", rows=fitted),
        label="SIMULATED arrivals (m workers from the measured, fitted build costs); combine REPLAYED: "
              "every composition really run and timed on this machine",
        model=str(model), threads=1, seam=seam, prompt_tokens=sum(lengths) + len(query), lengths=lengths,
        cost_model=dict(a_s=a, b_s_per_token=b, c_s_per_token2=c, observations=builds),
        build_sum_s=sum(t for _, t in builds), query_s=q, overhead_s=overhead_s,
        overhead_note=OVERHEAD_NOTE, overhead_source=overhead_source,
        longest_segment_tokens=max(lengths), longest_build_s=cost.predict(max(lengths)),
        rows=rows, passes=passes)


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
    import numpy as np

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


def measure_mesh(model: Path, reps: int, cold_tokens: int) -> dict:
    """Real cold requests through a mesh of our own (bench/serve.py's cold path: fresh documents
    on m = 2 scatter workers, full recompute of the same prompts, then m = 1)."""
    import tempfile

    from bench import serve as S
    from hypic.launcher import Mesh

    args = S.parse_args(["--model", str(model), "--cold-reps", str(reps), "--cold-tokens", str(cold_tokens)])
    with tempfile.TemporaryDirectory(prefix="hypic-bench-cold-") as d:
        with Mesh(model, Path(d), n_scatter=2, threads=1, start_timeout_s=300,
                  extra_args={"router": ["--max-prompt-tokens", str(max(32768, cold_tokens + 64))]}) as mesh:
            return S.cold_path(mesh, S.Encoder(model), args)


def _default_overhead() -> tuple[float, str]:
    """(fixed overhead, where it comes from): bench/results/cold.json's calibration (bench.serve's
    cold path), else none."""
    p = Path(__file__).resolve().parent / "results" / "cold.json"
    try:
        return float(json.loads(p.read_text())["simulated"]["overhead_s"]), "bench/results/cold.json"
    except (OSError, KeyError, ValueError):
        return 0.0, "none (bench/results/cold.json absent)"


def summary(res: dict) -> str:
    """The replay's table as text."""
    lines = [f"{res['prompt_tokens']} tokens in {len(res['lengths'])} segments; builds {res['build_sum_s']:.2f} s; "
             f"query {res['query_s'] * 1e3:.1f} ms; overhead {res['overhead_s'] * 1e3:.0f} ms "
             f"({res.get('overhead_source', '?')})"]
    for policy in POLICIES:
        for how in PARTITIONS:
            cells = "  ".join(f"m={r['m']}: {r['ttft_s']:5.2f} s x{r['speedup_vs_m1']:.2f} "
                              f"(tail {r['tail_after_last_arrival_s'] * 1e3:.0f} ms)"
                              for r in res["rows"] if r["policy"] == policy and r["partition"] == how)
            lines.append(f"  {policy:<8} {how:<11} {cells}")
    cells = "  ".join(f"m={r['m']}: {r['ttft_zero_cost_combine_s']:5.2f} s x{r['speedup_zero_cost_combine']:.2f}"
                      for r in res["rows"] if r["policy"] == "runs" and r["partition"] == "lpt")
    lines.append(f"  zero-cost combine, lpt {cells}")
    fit = res["run_cost_fit"]
    lines.append("  run cost fit: " + ", ".join(f"{k} {fit[k] * 1e3:.3f} ms" for k in RUN_FEATURES))
    cells = "  ".join(f"m={r['m']}: {r['ttft_s']:5.2f} s x{r['speedup_vs_m1']:.2f}"
                      for r in res["simulated_from_fits"]["rows"] if r["partition"] == "lpt")
    lines.append(f"  fitted   lpt         {cells}")
    return "\n".join(lines)


def plot_replay(res: dict, path) -> None:
    """Cold TTFT speedup over m = 1 against m: arrived runs per partitioning, in order (LPT), the
    builds alone and a zero-cost combine (LPT)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pick = lambda policy, how: [r for r in res["rows"] if r["policy"] == policy and r["partition"] == how]  # noqa: E731
    lpt = pick("runs", "lpt")
    ms = [r["m"] for r in lpt]
    for how, mk in zip(PARTITIONS, "osv"):
        rows = pick("runs", how)
        ax.plot([r["m"] for r in rows], [r["speedup_vs_m1"] for r in rows], marker=mk, label=f"arrived runs, {how}")
    rows = pick("in_order", "lpt")
    ax.plot(ms, [r["speedup_vs_m1"] for r in rows], marker="o", ls="--", color="grey", label="in order, lpt")
    ax.plot(ms, [r["speedup_zero_cost_combine"] for r in lpt], ls="-.", color="black",
            label="zero-cost combine, lpt (bound)")
    ax.plot(ms, [lpt[0]["makespan_s"] / r["makespan_s"] for r in lpt], ls=":", color="black",
            label="builds alone, lpt")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("scatter workers m")
    ax.set_ylabel("cold TTFT speedup vs m = 1")
    ax.set_title(f"SIMULATED arrivals, REPLAYED combine: {res['prompt_tokens']}-token request, "
                 f"{len(res['lengths'])} segments", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from hypic.launcher import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--overhead-s", type=float, default=None,
                    help="fixed mesh overhead added to every TTFT (default: bench/results/cold.json's)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cold_runs.json")
    ap.add_argument("--reprice", action="store_true",
                    help="run nothing: recompute --out's TTFTs for the overhead (e.g. after bench.serve "
                         "re-measured cold.json) and redraw its plot")
    ap.add_argument("--mesh", action="store_true",
                    help="also measure real cold requests through a mesh (m = 2, then m = 1; bench/serve.py)")
    ap.add_argument("--mesh-reps", type=int, default=3)
    ap.add_argument("--mesh-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    source = "--overhead-s"
    if args.mesh and not args.reprice:
        mesh = measure_mesh(args.model, args.mesh_reps, args.mesh_tokens)
        path = args.out.with_name(args.out.stem + "_mesh.json")
        path.write_text(json.dumps(mesh, indent=1))
        print(f"wrote {path}")
        if args.overhead_s is None:  # this run's own calibration
            args.overhead_s, source = mesh["simulated"]["overhead_s"], f"bench/results/{path.name}"
    if args.overhead_s is None:
        args.overhead_s, source = _default_overhead()
    if args.reprice:
        res = reprice(json.loads(args.out.read_text()), args.overhead_s, source)
    else:
        res = measure(args.model, args.tokens, args.seed, args.ms, args.seam, args.overhead_s, reps=args.reps,
                      overhead_source=source)
    print(summary(res))
    args.out.write_text(json.dumps(res, indent=1))
    plot_replay(res, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
