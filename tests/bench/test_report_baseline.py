"""bench.report_baseline: every ratio is against the better of full recompute and prefix cache
at its point, and says which; checked on random results against a plain recomputation, and on
the committed serve.json (where the baselines trade places)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.report_baseline import named, vs_best

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def fake_serve(g: random.Random) -> dict:
    modes = ("full", "prefix", "additive", "hypic")
    closed = {s: {"modes": {m: {"ttft_p50_s": g.uniform(0.1, 5)} for m in modes}} for s in ("rag", "agent")}
    rates = [0.5, 1.0, 2.0]
    sweep = {"rates": rates, "modes": {m: {"interpolated_qps": g.uniform(0.1, 5), "points": [
        {"rate": r, "ttft_p90_s": g.uniform(0.1, 9)} for r in rates if g.random() < 0.8]} for m in modes}}
    return {"closed": closed, "sweep": sweep}


def test_ratios_are_against_the_better_baseline(fresh_seed) -> None:
    g = random.Random(fresh_seed)
    for _ in range(200):
        serve = fake_serve(g)
        v = vs_best(serve)
        for shape, d in serve["closed"].items():
            t = {m: d["modes"][m]["ttft_p50_s"] for m in d["modes"]}
            want = "full" if t["full"] <= t["prefix"] else "prefix"
            e = v["ttft_p50_per_shape"][shape]
            assert e["baseline"] == want and abs(e["ratio"] - t[want] / t["hypic"]) < 1e-12
        q = {m: d["interpolated_qps"] for m, d in serve["sweep"]["modes"].items()}
        want = "full" if q["full"] >= q["prefix"] else "prefix"
        assert v["qps_at_slo"]["baseline"] == want
        assert abs(v["qps_at_slo"]["ratio"] - q["hypic"] / q[want]) < 1e-12
        for row in v["p90_by_rate"]:
            p90 = {m: next((p["ttft_p90_s"] for p in d["points"] if p["rate"] == row["rate"]), None)
                   for m, d in serve["sweep"]["modes"].items()}
            ran = {m: p90[m] for m in ("full", "prefix") if p90[m] is not None}
            assert p90["hypic"] is not None and row["value"] == min(ran.values())
            assert row["baseline"] in ran and ran[row["baseline"]] == row["value"]


def test_committed_results_name_the_baseline_that_served_more() -> None:
    serve = json.loads((RESULTS / "serve.json").read_text())
    v = vs_best(serve)
    sw = serve["sweep"]["modes"]
    best = max(("full", "prefix"), key=lambda m: sw[m]["interpolated_qps"])
    other = "prefix" if best == "full" else "full"
    assert v["qps_at_slo"]["baseline"] == best
    assert named(v["qps_at_slo"]).endswith("vs full recompute" if best == "full" else "vs prefix cache")
    assert v["qps_at_slo"]["ratio"] == pytest.approx(sw["hypic"]["interpolated_qps"] / sw[best]["interpolated_qps"])
    assert v["qps_at_slo"]["ratio"] <= sw["hypic"]["interpolated_qps"] / sw[other]["interpolated_qps"]
    assert serve["headline"]["vs_best_baseline"] == json.loads(json.dumps(v))
    assert named(None) == "—"


def _ratio_keys(x, path: str = "") -> list[str]:
    """Every key under `x` that names a ratio, a speedup or an 'x over y'."""
    found = []
    if isinstance(x, dict):
        for k, v in x.items():
            if any(w in str(k) for w in ("ratio", "speedup", "_over_", "_vs_")):
                found.append(f"{path}/{k}")
            found += _ratio_keys(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            found += _ratio_keys(v, f"{path}[{i}]")
    return found


def test_serve_headline_has_no_ratio_against_a_fixed_baseline(fresh_seed) -> None:
    """bench.serve's headline: hypic's ratios only inside vs_best_baseline (each naming its
    baseline); the committed serve*.json and reuse.json the same."""
    from bench.serve import headline

    g = random.Random(fresh_seed)
    for _ in range(20):
        serve = fake_serve(g)
        serve["shape"] = "rag"
        for d in serve["sweep"]["modes"].values():
            d["lower_bound"] = False
        serve["sweep"]["slo_s"] = 1.0
        h = headline(serve, None)
        assert h["vs_best_baseline"] == vs_best(serve)
        assert [k for k in _ratio_keys(h) if not k.startswith("/vs_best_baseline/")] == []
        assert h["qps_at_slo"] == {m: d["interpolated_qps"] for m, d in serve["sweep"]["modes"].items()}
    for path in sorted(RESULTS.glob("serve*.json")):
        h = json.loads(path.read_text()).get("headline", {})  # serve_cache.json: none
        assert [k for k in _ratio_keys(h) if not k.startswith(("/vs_best_baseline/", "/sim_", "/cold_"))] == [], path
    for row in json.loads((RESULTS / "reuse.json").read_text())["rows"]:
        b = min(("full", "prefix"), key=lambda m: row[f"{m}_s"])
        assert row["best_baseline"] == b and abs(row["speedup_vs_best"] - row[f"{b}_s"] / row["hypic_s"]) < 1e-12
        assert "speedup_vs_full" not in row and "speedup_vs_prefix" not in row


def test_serve_runs_the_baselines_alone(fresh_seed) -> None:
    """bench.serve --modes full prefix: the two baselines side by side (issue 27), no hypic and so
    no ratio; hypic alone with one baseline is refused."""
    import pytest

    from bench.serve import headline, parse_args

    assert parse_args(["--modes", "prefix", "full"]).modes == ["full", "prefix"]
    with pytest.raises(SystemExit):
        parse_args(["--modes", "full", "hypic"])
    serve = fake_serve(random.Random(fresh_seed))
    for part in (serve["sweep"]["modes"], *(d["modes"] for d in serve["closed"].values())):
        for mode in ("additive", "hypic"):
            del part[mode]
    serve.update(shape="rag")
    serve["sweep"]["slo_s"] = 1.0
    h = headline(serve, None)
    assert set(h["qps_at_slo"]) == {"full", "prefix"} and "qps_hypic_lower_bound" not in h
    assert h["vs_best_baseline"] == {"ttft_p50_per_shape": {}, "p90_by_rate": []}


def test_a_qps_ratio_is_a_lower_bound_when_hypic_never_missed_the_slo() -> None:
    from bench.report_baseline import named_qps

    e = dict(baseline="prefix", value=0.3, hypic=3.7, ratio=3.7 / 0.3)
    met = dict(sweep=dict(modes=dict(hypic=dict(lower_bound=True))))
    missed = dict(sweep=dict(modes=dict(hypic=dict(lower_bound=False))))
    assert named_qps(met, e) == "≥ 12.33× vs prefix cache"
    assert named_qps(missed, e) == "12.33× vs prefix cache" == named_qps({}, e)
    assert named_qps(met, None) == "—"
