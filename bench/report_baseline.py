"""Ratios against the best baseline at each point: the faster of full recompute and the prefix
cache (the one a user would pick without Hypic), named beside every ratio.

The prefix cache is not always the faster baseline: with little to reuse (RAG over a large
corpus) it prefills almost the whole prompt and keeps states besides, and under load its QPS
at the SLO came out below full recompute's in runs where the two were within the sweep's noise.
A ratio against the slower one would overstate Hypic's win, so every headline ratio is taken
against whichever baseline was better at that point: per shape for closed-loop TTFT, per rate
for p90 TTFT under load, and over the sweep for QPS at the SLO.

    vs_best(serve)   # {"ttft_p50": {"baseline": "full", "value": 2.42, "hypic": 0.56, "ratio": 4.3}, ...}
"""
from __future__ import annotations

BASELINES = ("full", "prefix")


def best(values: dict[str, float | None], higher_is_better: bool = False) -> tuple[str, float] | None:
    """(baseline, value) of the better of BASELINES among `values` (None/missing ones skipped)."""
    have = [(m, values[m]) for m in BASELINES if values.get(m) is not None]
    if not have:
        return None
    pick = max if higher_is_better else min
    return pick(have, key=lambda mv: mv[1])


def _entry(values: dict[str, float | None], higher_is_better: bool = False) -> dict | None:
    b = best(values, higher_is_better)
    h = values.get("hypic")
    if b is None or h is None:
        return None
    name, v = b
    if higher_is_better:
        ratio = h / v if v > 0 else None
    else:
        ratio = v / h if h > 0 else None
    return {"baseline": name, "value": v, "hypic": h, "ratio": ratio}


def vs_best(serve: dict) -> dict:
    """Every headline ratio of a bench.serve result against the best baseline at its point:
    ttft_p50 (the run's workload, RAG by default, closed loop), ttft_p50_per_shape, qps_at_slo, p90_by_rate (each rate the
    sweep ran hypic and at least one baseline at)."""
    out: dict = {}
    closed = serve.get("closed", {})
    per_shape = {}
    for shape, d in closed.items():
        e = _entry({m: s["ttft_p50_s"] for m, s in d["modes"].items()})
        if e:
            per_shape[shape] = e
    shape = serve.get("shape", "rag")  # the run's --workload (results written before it: RAG)
    if shape in per_shape:
        out["ttft_p50"] = per_shape[shape]
    out["ttft_p50_per_shape"] = per_shape
    sw = serve.get("sweep")
    if sw:
        e = _entry({m: d["interpolated_qps"] for m, d in sw["modes"].items()}, higher_is_better=True)
        if e:
            out["qps_at_slo"] = e
        by_rate = []
        for r in sw["rates"]:
            p90 = {m: next((p["ttft_p90_s"] for p in d["points"] if abs(p["rate"] - r) < 1e-12), None)
                   for m, d in sw["modes"].items()}
            e = _entry(p90)
            if e:
                by_rate.append(dict(rate=r, **e))
        out["p90_by_rate"] = by_rate
    return out


def named(e: dict | None) -> str:
    """'4.30× vs full recompute' for a vs_best entry ('—' without one)."""
    if not e or e.get("ratio") is None:
        return "—"
    return f"{e['ratio']:.2f}× vs {'full recompute' if e['baseline'] == 'full' else 'prefix cache'}"


def named_qps(serve: dict, e: dict | None) -> str:
    """named() of a QPS-at-SLO entry, '≥ ' first when hypic met the SLO at every rate it ran (its QPS,
    and so the ratio, is then a lower bound)."""
    sw = serve.get("sweep") or {}
    lower = sw.get("modes", {}).get("hypic", {}).get("lower_bound", False)
    text = named(e)
    return f"≥ {text}" if lower and text != "—" else text
