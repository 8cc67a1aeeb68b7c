"""docs/results.md's section on cutting long segments (common/engine/cut.py), from the runs of its
own: bench/quality/results/quality_cut.json (`python -m bench.quality.eval --cut`: the quality
cost), bench/results/cold_cut.json (`python -m bench.cold_cut`: the simulated m = 8 cold path)
and bench/results/cold_cut_mesh.json (`python -m bench.cold_cut_mesh`: the mesh at m = 2)."""
from __future__ import annotations

import json
from pathlib import Path

from common.engine.cut import DEFAULT_CUT_TOKENS


def load_cut(results: Path) -> dict | None:
    """The three results that exist (None when none does)."""
    paths = {"quality": results.parent / "quality" / "results" / "quality_cut.json",
             "sim": results / "cold_cut.json", "mesh": results / "cold_cut_mesh.json"}
    out = {k: json.loads(p.read_text()) for k, p in paths.items() if p.exists()}
    return out or None


def _quality(q: dict) -> list[str]:
    modes = q["modes"]
    label = lambda m: "full recompute" if m == "full" else ("whole" if m == "cut_whole" else f"L = {m[3:]}")  # noqa: E731
    out = [f"**Quality** (`python -m bench.quality.eval --cut`, {q['n_per_task']} prompts per task): the "
           "prompt's documents joined into one document "
           f"(~{round(sum(v['mean'] for v in q['prompt_tokens'].values()) / len(q['tasks']))} tokens), cached whole "
           "or cut at L by the router's rule, hypic with seam 8; exact match, %:", "",
           "| task | " + " | ".join(label(m) for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    for t in q["tasks"]:
        out.append(f"| {t} | " + " | ".join(f"{q['accuracy'][t][m]:.1f}" for m in modes) + " |")
    mean = {m: sum(q["accuracy"][t][m] for t in q["tasks"]) / len(q["tasks"]) for m in modes}
    out.append("| mean | " + " | ".join(f"{mean[m]:.1f}" for m in modes) + " |")
    return out + [""]


def _sim(s: dict) -> list[str]:
    rows = {(r["cut_tokens"], r["m"]): r for r in s["rows"]}
    cuts = list(dict.fromkeys(r["cut_tokens"] for r in s["rows"]))
    ms = sorted({r["m"] for r in s["rows"]})
    out = ["**Cold path, m workers** (`python -m bench.cold_cut`, **simulated** from `cold_runs.json`'s fitted "
           "build and pass costs: the 33-segment 32k-token request cut at L, LPT, the combine in arrived runs "
           "charged for every extra seam; fixed overhead "
           f"{s['overhead_s'] * 1e3:.0f} ms). TTFT and speedup over m = 1 with the segments whole:", "",
           "| L | pieces | longest | " + " | ".join(f"m = {m}" for m in ms) + " |", "|---|---:|---:|" + "---:|" * len(ms)]
    for c in cuts:
        r1 = rows[(c, ms[0])]
        out.append(f"| {c} | {r1['pieces']} | {r1['longest']} | " + " | ".join(
            f"{rows[(c, m)]['ttft_s']:.2f} s ({rows[(c, m)]['speedup_vs_whole_m1']:.2f}×)" for m in ms) + " |")
    return out + [""]


def _mesh(m: dict) -> list[str]:
    p50 = m["ttft_p50_s"]
    return [f"**Cold path on the mesh** (`python -m bench.cold_cut_mesh`, measured, m = {m['m']}): two fresh "
            f"documents of {m['documents_tokens'][0]} and {m['documents_tokens'][1]} tokens, {m['reps']} requests "
            f"each way, alternated: TTFT p50 {p50['whole'] * 1e3:.0f} ms whole, {p50['cut'] * 1e3:.0f} ms cut at "
            f"L = {m['cut_tokens']}: **{m['speedup_cut_vs_whole']:.2f}×**.", ""]


def cut_section(cut: dict) -> list[str]:
    out = ["### Cutting long segments", "",
           "The router caches a segment longer than `--cut-tokens` (default "
           f"{DEFAULT_CUT_TOKENS}) as pieces of at most that many tokens, as equal as the length allows "
           "(`cut_segment`), each its own entry with a seam; a request's `keep_whole` turns it off.", ""]
    if "quality" in cut:
        out += _quality(cut["quality"])
    if "sim" in cut:
        out += _sim(cut["sim"])
    if "mesh" in cut:
        out += _mesh(cut["mesh"])
    return out + _choice(cut)


def _choice(cut: dict) -> list[str]:
    """Why the default: the fastest L at the largest m, and the quality cost measured."""
    out = []
    if "sim" in cut:
        top = max(r["m"] for r in cut["sim"]["rows"])
        at = [r for r in cut["sim"]["rows"] if r["m"] == top]
        fast = max(at, key=lambda r: r["speedup_vs_whole_m1"])
        whole = next(r for r in at if r["cut_tokens"] == "whole")
        out.append(f"At m = {top} the fastest is L = {fast['cut_tokens']}: {fast['speedup_vs_whole_m1']:.2f}× "
                   f"({fast['speedup_vs_whole_m1_compute_only']:.2f}× without the fixed overhead) against "
                   f"{whole['speedup_vs_whole_m1']:.2f}× whole; shorter pieces lose it again, each adding a seam "
                   "to the composition.")
    if "quality" in cut:
        q = cut["quality"]
        worst = min(0.0, *(d for t in q["tasks"] for m, d in q["delta_vs_full"][t].items() if m != "full"))
        out.append(f"The largest accuracy loss against full recompute at any L measured: {abs(worst):.1f} points "
                   f"({q['n_per_task'] * len(q['tasks'])} prompts; pieces as short as "
                   f"{min(int(m[3:]) for m in q['modes'] if m[3:].isdigit())} tokens).")
    return [" ".join(out), ""] if out else []
