"""The cold path through a mesh: cold requests of fresh documents never seen before (skewed
segment lengths) on m = 2 scatter workers, then on m = 1 (scatter1 stopped: the router's planner
marks it down and sends every miss to scatter0), with full recompute of the same prompts alongside.
A CostModel fitted on the builds these requests report, and the per-segment compose and query
costs they measured, give the SIMULATED table of m = 1, 2, 4, 8 workers (bench/cold_model.py); the
fixed overhead (router, lookup, transfers) is calibrated so the simulation matches the measured
m = 1 TTFT, and the measured m = 2 TTFT is reported next to the simulated one as a check.

Run by `python -m bench.serve` (its last phase, cold.json) and `python -m bench.cold --mesh`.
"""
from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import cold_model as C
from bench import workloads as W
from bench.driver import Encoder, drive, log, median
from hypic.launcher import Mesh


@dataclass
class ColdParams:
    """What the cold path reads of bench.serve's arguments; bench.serve's defaults are these."""
    cold_tokens: int = 8192
    cold_reps: int = 5
    seed: int = 0
    doc_tokens: tuple[int, int] = (128, 2048)
    sim_tokens: int = 32768
    sim_m: tuple[int, ...] = (1, 2, 4, 8)


def cold_path(mesh: Mesh, enc: Encoder, args: ColdParams) -> dict:
    """Fresh documents, m = 2 then m = 1 (scatter1 stopped); the simulation (bench/cold_model.py)."""
    lengths = W.skewed_lengths(args.cold_tokens, seed=args.seed * 1000 + 7, lo=128,
                               hi=max(256, args.doc_tokens[1]))
    log(f"\n== cold path: {sum(lengths)} tokens in {len(lengths)} segments {lengths}")

    def fresh(rep: int, tag: int) -> W.Request:
        rng = random.Random(10_000_000 + args.seed * 1000 + 10 * rep + tag)
        docs = [W.make_document(rng, 900_000 + i, L) for i, L in enumerate(lengths)]
        q = ("<q>", "find", rng.choice(docs[0].keys), "<a>")
        return W.Request(rep, 0.0, [d.words for d in docs], q,
                         [900_000 + 1000 * (10 * rep + tag) + i for i in range(len(docs))])

    runs: dict[str, list[dict]] = {}
    m2_reqs = [fresh(rep, 2) for rep in range(args.cold_reps)]
    runs["m2"], _ = drive(mesh.router_address, m2_reqs, "hypic", enc, max_tokens=2)
    runs["full"], _ = drive(mesh.router_address, m2_reqs, "full", enc, max_tokens=2)
    mesh.kill("scatter1")
    time.sleep(max(3.0, 3 * 1.0))  # the router polls Scatter.Load every second: scatter1 goes down
    probe = fresh(99, 9)
    probe.segments = probe.segments[:2]
    probe.doc_ids = probe.doc_ids[:2]
    drive(mesh.router_address, [probe], "hypic", enc, max_tokens=1)
    runs["m1"], _ = drive(mesh.router_address, [fresh(rep, 1) for rep in range(args.cold_reps)], "hypic",
                          enc, max_tokens=2)
    for k, recs in runs.items():
        errs = [r["error"] for r in recs if "error" in r]
        if errs:
            raise RuntimeError(f"cold {k}: {errs[0]}")
    workers = {k: sorted({b[2] for r in runs[k] for b in r.get("builds", [])}) for k in ("m1", "m2")}
    hits = {k: sum(r.get("hits", 0) for r in runs[k]) for k in ("m1", "m2")}
    med = {k: median([r["ttft_s"] for r in recs]) for k, recs in runs.items()}
    best = {k: min(r["ttft_s"] for r in recs) for k, recs in runs.items()}
    m1 = runs["m1"]
    builds_m1 = [(b[0], b[1]) for r in m1 for b in r["builds"]]
    builds_m2 = [(b[0], b[1]) for r in runs["m2"] for b in r["builds"]]
    cost = C.fit_cost_model(builds_m1)
    per_seg_compose = median([(r["compose_s"] + r["seams_s"]) / r["segments"] for r in m1])
    query_s = median([r["query_s"] for r in m1])
    compose = lambda L: per_seg_compose  # noqa: E731 (seam recompute + body append: ~constant per segment)
    sim_m1 = C.simulate(lengths, 1, "lpt", cost, compose, query_s).ttft_s
    overhead = med["m1"] - sim_m1
    sim_m2 = C.simulate(lengths, 2, "lpt", cost, compose, query_s, overhead).ttft_s
    measured = dict(prompt_tokens=sum(lengths) + 4, segments=len(lengths), reps=args.cold_reps,
                    m1_ttft_s=med["m1"], m2_ttft_s=med["m2"], full_ttft_s=med["full"],
                    speedup_m2=med["m1"] / med["m2"], m2_vs_full=med["full"] / med["m2"],
                    best_m1_ttft_s=best["m1"], best_m2_ttft_s=best["m2"], best_full_ttft_s=best["full"],
                    speedup_m2_best=best["m1"] / best["m2"],
                    build_sum_m1_s=median([sum(b[1] for b in r["builds"]) for r in runs["m1"]]),
                    build_sum_m2_s=median([sum(b[1] for b in r["builds"]) for r in runs["m2"]]),
                    m1_ttft_all_s=[r["ttft_s"] for r in runs["m1"]],
                    m2_ttft_all_s=[r["ttft_s"] for r in runs["m2"]],
                    full_ttft_all_s=[r["ttft_s"] for r in runs["full"]],
                    workers_used=workers, hits=hits, sim_m2_lpt_ttft_s=sim_m2)
    log(f"  measured cold TTFT (median of {args.cold_reps}): m=1 {med['m1']:.2f} s, m=2 {med['m2']:.2f} s "
        f"-> x{measured['speedup_m2']:.2f} (best of {args.cold_reps}: x{measured['speedup_m2_best']:.2f}); "
        f"full recompute {med['full']:.2f} s; simulated m=2 {sim_m2:.2f} s; builds per request "
        f"{measured['build_sum_m1_s']:.2f} s (m=1) / {measured['build_sum_m2_s']:.2f} s (m=2, summed over workers)")
    L32 = W.skewed_lengths(args.sim_tokens, seed=args.seed * 1000 + 8, lo=128, hi=4096)
    rows = C.simulate_table(L32, args.sim_m, cost, compose, query_s, overhead)
    a, b, c = cost.coefficients
    simulated = dict(label="SIMULATED from measured per-segment costs (not run on the mesh)",
                     prompt_tokens=sum(L32), lengths=L32, ms=list(args.sim_m), rows=rows,
                     cost_model=dict(a_s=a, b_s_per_token=b, c_s_per_token2=c, observations=builds_m1,
                                     observations_m2=builds_m2),
                     compose_per_segment_s=per_seg_compose, query_s=query_s, overhead_s=overhead)
    for how in C.PARTITIONS:
        cells = "  ".join(f"m={r['m']}: {r['ttft_s']:6.2f} s x{r['speedup_vs_m1']:.2f}"
                          for r in rows if r["partition"] == how)
        log(f"  SIMULATED {sum(L32)}-token request, {how:<11} {cells}")
    return {"label": "cold path: measured m = 1 and 2 on the mesh; larger m SIMULATED",
            "lengths": lengths, "measured": measured, "simulated": simulated}




def measure_mesh(model: Path, reps: int, cold_tokens: int) -> dict:
    """Real cold requests through a mesh of our own (cold_path, m = 2 then 1), as bench.cold --mesh."""
    params = ColdParams(cold_tokens=cold_tokens, cold_reps=reps)
    with tempfile.TemporaryDirectory(prefix="hypic-bench-cold-") as d:
        with Mesh(model, Path(d), n_scatter=2, threads=1, start_timeout_s=300,
                  extra_args={"router": ["--max-prompt-tokens", str(max(32768, cold_tokens + 64))]}) as mesh:
            return cold_path(mesh, Encoder(model), params)
