"""Cold path with long segments cut (common/engine/cut.py), SIMULATED from the measured replay's
fits alone (`python -m bench.cold_cut`, reads bench/results/cold_runs.json, writes
bench/results/cold_cut.json; no model run).

The 33-segment, 32k-token request of bench.cold: its segments cut at L by the router's own
cut_segment, placed by the router's Planner (LPT) over the CostModel re-fitted on the replay's
measured builds, the combine in arrived runs costed by the pass fit (bench.cold_model.run_cost,
which charges every extra seam the cut adds), the replay's fixed overhead and query time. Each
row's speedup is against m = 1 with the segments whole (the request as it was), and against
m = 1 with the same cut.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from bench.cold_model import RUN_FEATURES, fit_cost_model, run_cost, simulate
from common.engine.cut import cut_segment

RESULTS = Path(__file__).resolve().parent / "results"
CUTS = (0, 1024, 768, 512, 256, 128)


def cut_lengths(lengths: Sequence[int], cut_tokens: int) -> list[int]:
    """The pieces' lengths, in request order (the same rule the router applies to the ids)."""
    return [len(p) for L in lengths for p in cut_segment(range(L), cut_tokens)]


def cut_rows(res: dict, cuts: Sequence[int] = CUTS, ms: Sequence[int] = (1, 2, 4, 8)) -> list[dict]:
    """One row per (L, m): TTFT, last arrival, pieces, speedups (see the module docstring)."""
    cost = fit_cost_model([tuple(o) for o in res["cost_model"]["observations"]])
    fit = {k: res["run_cost_fit"][k] for k in RUN_FEATURES}
    q, ov = res["query_s"], res["overhead_s"]

    def ttft(lengths: list[int], m: int):
        return simulate(lengths, m, "lpt", cost, lambda L: 0.0, q, ov, run_s=run_cost(fit, lengths))

    whole_m1 = ttft(list(res["lengths"]), 1).ttft_s
    rows = []
    for L in cuts:
        lengths = cut_lengths(res["lengths"], L)
        cut_m1 = ttft(lengths, 1).ttft_s
        for m in ms:
            r = ttft(lengths, m)
            rows.append(dict(cut_tokens=L or "whole", m=m, pieces=len(lengths), longest=max(lengths),
                             ttft_s=r.ttft_s, last_arrival_s=r.makespan_s,
                             speedup_vs_whole_m1=whole_m1 / r.ttft_s, speedup_vs_same_cut_m1=cut_m1 / r.ttft_s,
                             speedup_vs_whole_m1_compute_only=(whole_m1 - ov) / (r.ttft_s - ov)))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=RESULTS / "cold_runs.json")
    ap.add_argument("--out", type=Path, default=RESULTS / "cold_cut.json")
    args = ap.parse_args(argv)
    res = json.loads(args.runs.read_text())
    rows = cut_rows(res)
    out = dict(label="SIMULATED from cold_runs.json's fitted build and pass costs; segments cut by "
                     "common.engine.cut.cut_segment", source=str(args.runs.name),
               overhead_s=res["overhead_s"], query_s=res["query_s"], rows=rows)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"L={r['cut_tokens']!s:>5} m={r['m']} pieces={r['pieces']:3d} longest={r['longest']:4d} "
              f"ttft={r['ttft_s']:.3f}s  x{r['speedup_vs_whole_m1']:.2f} vs whole m=1, "
              f"x{r['speedup_vs_same_cut_m1']:.2f} vs the same cut at m=1, "
              f"x{r['speedup_vs_whole_m1_compute_only']:.2f} without the overhead")


if __name__ == "__main__":
    main()
