"""bench/steady.py, the warm-up until hypic's hit rate stops rising: the plateau rule on rising,
flat and noisy curves, the hit rate of a round's records, and `bench.serve --steady` on a real
mesh of the bundled model (the curve in its JSON, the caches warmer after the first round)."""
from __future__ import annotations

import json

import pytest

from bench.steady import SteadyRule


def test_a_rising_curve_keeps_warming_and_a_flat_one_stops():
    rule = SteadyRule(round_requests=4, eps=0.02, patience=2, max_rounds=10)
    rising = [0.2, 0.35, 0.45, 0.52, 0.58]
    assert not any(rule.plateaued(rising[:k]) for k in range(1, len(rising) + 1))
    flat = [0.2, 0.5, 0.51, 0.5, 0.52]  # rounds 4-5 average within eps of rounds 2-3
    assert [rule.plateaued(flat[:k]) for k in range(1, 6)] == [False] * 4 + [True]
    # rounds 3-4 averaged 0.405 against 0.35 before: still rising
    assert not rule.plateaued([0.2, 0.5, 0.51, 0.30])


def test_noise_around_a_rising_mean_does_not_end_the_warm_up():
    """One high round (a maximum of noisy values) must not make the next ones look flat: a rule
    against the best round so far would stop here, the means see the rise."""
    rule = SteadyRule(patience=2, eps=0.02, max_rounds=10)
    assert not rule.plateaued([0.20, 0.60, 0.52, 0.58])  # 0.55 against 0.40
    assert rule.plateaued([0.20, 0.60, 0.52, 0.58, 0.56, 0.55])  # 0.555 against 0.55


def test_patience_one_and_zero_eps():
    rule = SteadyRule(patience=1, eps=0.0, max_rounds=3)
    assert not rule.plateaued([0.4])
    assert not rule.plateaued([0.4, 0.41])
    assert rule.plateaued([0.4, 0.4])


@pytest.mark.parametrize("kw", [dict(round_requests=0), dict(patience=0), dict(eps=-0.1),
                                dict(patience=3, max_rounds=5), dict(max_rounds=501)])
def test_a_rule_that_could_never_end_or_never_measure_is_refused(kw):
    with pytest.raises(ValueError):
        SteadyRule(**kw)


def test_serve_refuses_steady_without_hypic():
    from bench import serve

    with pytest.raises(SystemExit):
        serve.parse_args(["--steady", "--modes", "full", "prefix"])
    with pytest.raises(SystemExit):
        serve.parse_args(["--steady", "--steady-patience", "3", "--steady-max-rounds", "5"])
    with pytest.raises(SystemExit):  # round seeds would run into the next seed's block
        serve.parse_args(["--steady", "--steady-max-rounds", "501"])
    assert serve.parse_args(["--steady", "--steady-max-rounds", "500"]).steady_max_rounds == 500


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_steady_warm_up_writes_its_curve(tmp_path):
    """`bench.serve --steady` on the agent workload: rounds of fresh requests until the hit rate
    stops rising (or the round cap), the curve in serve_agent.json, the later rounds hitting what
    the first built (a session's tool descriptions recur)."""
    from bench import serve

    out = serve.main(["--quick", "--workload", "agent", "--shapes", "agent", "--modes", "full", "prefix", "hypic",
                      "--no-cold", "--no-plots", "--no-sweep", "--steady", "--steady-round", "4",
                      "--steady-max-rounds", "4", "--out", str(tmp_path)])
    st = out["warm_up"]["steady"]["agent"]
    rates = [p["hit_rate"] for p in st["curve"]]
    assert 2 <= st["rounds"] == len(rates) <= 4 and st["requests_per_mode"] == 4 * st["rounds"]
    assert all(0.0 <= r <= 1.0 for r in rates) and max(rates[1:]) > rates[0]
    assert all(0.0 <= p["prefix_hit_rate"] <= 1.0 and p["errors"] == 0 for p in st["curve"])
    # the round's hits split by tier, as the closed loop's (bench.driver.summarize)
    assert all(sum(p["hits_by_tier"].values()) == pytest.approx(p["hit_rate"]) for p in st["curve"] if p["hit_rate"])
    assert st["reached"] == SteadyRule(**st["rule"]).plateaued(rates)
    assert out["closed"]["agent"]["modes"]["hypic"]["n"] == 4
    saved = json.loads((tmp_path / "serve_agent.json").read_text())
    assert saved["warm_up"]["steady"]["agent"]["curve"] == json.loads(json.dumps(st["curve"]))


def test_the_report_gives_the_curve_and_says_when_the_cap_ended_it():
    from bench.report_models import steady_lines, warm_label

    curve = [dict(round=k + 1, requests=8 * (k + 1), hit_rate=r, prefix_hit_rate=0.05, wall_s=60.0, errors=0)
             for k, r in enumerate([0.31, 0.55, 0.62])]
    st = dict(rule=dict(round_requests=8, eps=0.02, patience=1, max_rounds=3), curve=curve, reached=False,
              rounds=3, requests_per_mode=24, wall_s=180.0)
    text = " ".join(steady_lines(st))
    assert "8: 31%, 16: 55%, 24: 62%" in text and "still rising" in text
    assert warm_label(dict(warm_up=dict(steady=dict(rag=st)))) == "capped warm-up"
    st.update(reached=True)
    assert "stopped rising after 3 rounds (the cap)" in " ".join(steady_lines(st))
    st.update(rounds=2, curve=curve[:2])
    assert "stopped rising after 2 rounds (" in " ".join(steady_lines(st))
    assert steady_lines(None) == [] and warm_label({}) == "short warm-up"
