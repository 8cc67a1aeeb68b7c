"""The evaluation's drift figures (issue 26) on the bundled model: run_prompt's KL, top-1 and decode
agreement are common.engine.drift's, and the committed drift_offline.json (what the mesh's shadow
monitor is compared with) is what bench.quality.drift_offline computes for these weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "hypic-tiny-qwen35"
OFFLINE = ROOT / "bench" / "quality" / "results" / "drift_offline.json"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="bundled model missing")


@pytest.fixture(scope="module")
def engine():
    from bench.quality import eval as E

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield E.load_engine(MODEL)
    torch.set_num_threads(n)


def test_run_prompt_drift_figures_are_measure_drifts(engine):
    from bench.quality import eval as E
    from common.engine.drift import measure_drift

    modes = ("full", "additive", "hypic_w0", "hypic_w8")
    segments, query, answer = E.prompt_ids(engine, "update", 1)
    plain = E.run_prompt(engine, segments, query, answer, modes)
    drift = E.run_prompt(engine, segments, query, answer, modes, drift_steps=6)
    prompt = [t for s in segments for t in s] + query
    for m in modes:
        # the longer decode does not change the prediction or its margin (over the answer's steps)
        assert (drift[m]["pred"], drift[m]["ok"]) == (plain[m]["pred"], plain[m]["ok"])
        assert drift[m]["margin"] == pytest.approx(plain[m]["margin"], abs=1e-5)
        assert "agreement" not in plain[m] and 0.0 <= drift[m]["agreement"] <= 1.0
        assert drift[m]["kl"] == pytest.approx(plain[m]["kl"], abs=1e-6) and drift[m]["top1"] == plain[m]["top1"]
    assert drift["full"]["kl"] == pytest.approx(0.0, abs=1e-6) and drift["full"]["top1"]
    assert drift["full"]["agreement"] == 1.0
    # the additive ablation moves the query's distribution measurably on an update prompt
    assert drift["additive"]["kl"] > 1e-3
    # measure_drift (full recompute by engine.prefill, not prefill_segments) gives the same figures
    out = engine.prefill_segments(segments, query, mode="additive")
    tokens, _ = E.greedy(engine, out, 6)
    ref = measure_drift(engine, prompt, tokens, tokens, out.logits)
    assert drift["additive"]["kl"] == pytest.approx(ref.kl, rel=1e-3, abs=1e-5)
    assert drift["additive"]["top1"] == ref.top1_agree
    assert drift["additive"]["agreement"] == ref.agreement


@pytest.mark.skipif(not OFFLINE.exists(), reason="drift_offline.json not written")
def test_drift_offline_json_is_this_models(engine):
    from bench.quality import drift_offline as D
    from bench.quality import eval as E
    from bench.quality import tasks as T

    off = json.loads(OFFLINE.read_text())
    assert off["fingerprint"] == engine.fingerprint, "drift_offline.json was computed for other weights"
    assert (off["mode"], off["seam"], off["steps"]) == ("hypic", E.OFFLINE_SEAM, E.OFFLINE_STEPS)
    prompts = off["prompts"]
    assert off["n_prompts"] == len(prompts) == E.OFFLINE_PER_TASK * len(T.TASKS)
    assert {p["task"] for p in prompts} == set(T.TASKS)
    assert off["summary"]["kl_mean"] == pytest.approx(sum(p["kl"] for p in prompts) / len(prompts))
    assert off["summary"]["agreement_mean"] == pytest.approx(sum(p["agreement"] for p in prompts) / len(prompts))
    assert off["summary"]["top1_agree"] == pytest.approx(sum(p["top1_agree"] for p in prompts) / len(prompts))
    for p in prompts:
        assert len(p["generated"]) == p["steps"] == off["steps"]
    # two prompts recomputed: the same ids, tokens and figures
    for p in (prompts[0], prompts[-1]):
        again = D.offline_prompt(engine, p["task"], p["index"], off["seam"], off["steps"])
        assert (again["segments"], again["query"], again["generated"]) == (p["segments"], p["query"], p["generated"])
        assert again["kl"] == pytest.approx(p["kl"], rel=1e-3, abs=1e-6)
        assert (again["top1_agree"], again["agreement"]) == (p["top1_agree"], p["agreement"])


def test_published_intervals_and_drift_figures_are_consistent():
    from bench import results_json
    from bench.quality import eval as E

    q = results_json.load(ROOT / "bench" / "quality" / "results" / "quality.json")
    if "interval95" not in q:
        pytest.skip("quality.json written before the intervals")
    assert q["interval95"] == E.intervals(q["correct"])
    for t in q["tasks"]:
        for m in q["modes"]:
            lo, hi = q["interval95"][t][m]
            assert lo <= q["accuracy"][t][m] <= hi
    if "decode_agreement" in q:
        for t in q["tasks"]:
            # full recompute against itself: no divergence, every step agrees
            assert q["query_kl"][t]["full"] == pytest.approx(0.0, abs=1e-6)
            assert q["decode_agreement"][t]["full"]["mean"] == 100.0
            for m in q["modes"]:
                a = q["decode_agreement"][t][m]
                assert 0.0 <= a["interval95"][0] <= a["mean"] <= a["interval95"][1] + 1e-9 and a["mean"] <= 100.0
