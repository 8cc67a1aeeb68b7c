"""Cold path, measured replay (`python -m bench.cold`, bench/results/cold_runs.json): a 32k-token
request of skewed segment lengths on one process, one torch thread. Every segment's entry is really
built (its build time is the observation the CostModel is fitted on); the arrival times of the
builds on m workers come from that fitted model (bench/cold_model.py: m workers cannot run side by
side on this machine); the combine is REPLAYED on a virtual clock with the real engine: each
composition really runs and advances the clock by its measured time. Two combine policies on the
same arrivals:
- in_order: segment i composed once it and all before it are in (compose_segment), the old path;
- runs: whenever the combine is free, the run of consecutive arrived segments from the next one
  in one layer-major pass (compose_run), what services/combine does now.

`--mesh` first measures real cold requests through a mesh of our own (bench/cold_mesh.py) and
calibrates the fixed overhead on them; `--reprice` only recomputes the TTFTs of an existing
cold_runs.json for another overhead.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.cold_mesh import measure_mesh
from bench.cold_model import (OVERHEAD_NOTE, PARTITIONS, RUN_FEATURES, add_ttft, arrivals, combine_in_runs,
                              fit_cost_model, fit_run_cost, fitted_table, reprice)
from bench.driver import timed
from bench.plots import plot_replay
from bench.workloads import skewed_lengths
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.reuse import compose_run, compose_segment
from hypic.launcher import DEFAULT_MODEL

POLICIES = ("in_order", "runs")


class Replay:
    """The combine's compositions of one request, really run on `engine` on a virtual clock."""

    def __init__(self, engine, entries):
        self.engine, self.entries = engine, entries
        self.passes: list[dict] = []  # per pass: segments, prefix tokens, run tokens, seconds

    def run(self, arrival: Sequence[float], policy: str) -> tuple[float, list[int], Any]:
        """(when the combine is done, segments per pass, the composed state)."""
        eng, entries = self.engine, self.entries
        capacity = sum(e.n_tokens for e in entries)  # keys into one arena per layer, as combine does
        state = eng.new_state()
        self.passes = []

        def run_s(run: range) -> float:
            nonlocal state
            prefix = state.seq_len
            if policy == "in_order":
                secs, state = timed(compose_segment, eng, state, entries[run.start])
            else:
                secs, state = timed(compose_run, eng, state, [entries[j] for j in run], capacity)
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
            secs, e = timed(build_entry, engine, s, seam)
            build_s[i] = min(build_s[i], secs)
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
        query_s += [timed(engine.forward, query, state)[0] for _ in range(3)]
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

def main(argv: Sequence[str] | None = None) -> None:
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
