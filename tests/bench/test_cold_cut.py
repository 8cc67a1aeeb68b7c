"""bench.cold_cut: the cut request's lengths are the router's cut of the measured lengths, the
uncut rows equal bench.cold_model's fitted table on the same JSON, and cutting the longest
segment moves the m = 8 TTFT below the whole request's (its last arrival was that segment)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cold_cut import cut_lengths, cut_rows
from bench.cold_model import RUN_FEATURES, fit_cost_model, fitted_table

RUNS = Path(__file__).resolve().parents[2] / "bench" / "results" / "cold_runs.json"


def test_cut_lengths_follow_the_cut_rule() -> None:
    assert cut_lengths([10, 3, 25], 8) == [5, 5, 3, 7, 6, 6, 6]
    assert cut_lengths([10, 3], 0) == [10, 3]


def test_cut_rows_agree_with_the_fitted_table_and_the_cut_helps_at_m8() -> None:
    res = json.loads(RUNS.read_text())
    rows = cut_rows(res, cuts=(0, 1024), ms=(1, 8))
    cost = fit_cost_model([tuple(o) for o in res["cost_model"]["observations"]])
    fit = {k: res["run_cost_fit"][k] for k in RUN_FEATURES}
    table = fitted_table(res["lengths"], [1, 8], cost, fit, res["query_s"], res["overhead_s"])
    lpt8 = next(r for r in table if r["partition"] == "lpt" and r["m"] == 8)
    whole8 = next(r for r in rows if r["cut_tokens"] == "whole" and r["m"] == 8)
    assert whole8["ttft_s"] == pytest.approx(lpt8["ttft_s"])
    assert whole8["speedup_vs_whole_m1"] == pytest.approx(lpt8["speedup_vs_m1"])
    cut8 = next(r for r in rows if r["cut_tokens"] == 1024 and r["m"] == 8)
    assert cut8["longest"] <= 1024 < max(res["lengths"])
    assert cut8["last_arrival_s"] < whole8["last_arrival_s"] and cut8["ttft_s"] < whole8["ttft_s"]
