"""The router's LPT planner and its cost model, pure: no process, no network."""

from __future__ import annotations

import math
import random

import pytest

from services.router.planner import (CostModel, Job, Planner, contiguous, lpt, makespan,
                                     round_robin)


def test_cost_model_prior_is_sane_before_data() -> None:
    cm = CostModel((0.02, 2e-4, 2e-9))
    assert cm.n == 0
    a, b, c = cm.coefficients
    assert math.isclose(a, 0.02, rel_tol=1e-6) and math.isclose(b, 2e-4, rel_tol=1e-6)
    assert math.isclose(c, 2e-9, rel_tol=1e-6)
    preds = [cm.predict(L) for L in (1, 16, 256, 4096, 32768)]
    assert all(p > 0 for p in preds) and preds == sorted(preds)
    assert cm.predict(0) == 0.0


def test_cost_model_fits_quadratic_online(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    true = (0.015, 3e-5, 4e-9)
    cm = CostModel()
    for _ in range(300):
        L = int(2 ** rng.uniform(4, 14))  # segment lengths span orders of magnitude
        t = (true[0] + true[1] * L + true[2] * L * L) * rng.uniform(0.97, 1.03)
        assert cm.observe(L, t)
    for L in (64, 1024, 4096, 16000):
        want = true[0] + true[1] * L + true[2] * L * L
        assert abs(cm.predict(L) - want) / want < 0.06, (L, cm.predict(L), want)
    assert all(c >= 0 for c in cm.coefficients)


def test_cost_model_ignores_bad_numbers_and_follows_one_length() -> None:
    cm = CostModel()
    for bad in [(0, 1.0), (100, 0.0), (100, -1.0), (100, float("nan")), (float("inf"), 1.0)]:
        assert not cm.observe(*bad)
    assert cm.n == 0
    for _ in range(50):
        cm.observe(100, 0.5)  # much slower than the prior at one length only
    assert abs(cm.predict(100) - 0.5) < 0.05
    assert cm.predict(1000) >= cm.predict(100) > cm.predict(10) > 0  # still increasing


def test_lpt_beats_round_robin_and_contiguous_on_skewed_lengths() -> None:
    # A RAG-like prompt: a few long documents next to each other, many short ones.
    lengths = [8192, 6144, 4096, 4096] + [256] * 20 + [2048, 1024] + [128] * 6
    cm = CostModel()
    costs = [cm.predict(L) for L in lengths]
    m = 4
    span = {name: makespan(costs, f(costs, m), m)
            for name, f in (("lpt", lpt), ("rr", round_robin), ("contiguous", contiguous))}
    lower = max(max(costs), sum(costs) / m)
    assert span["lpt"] < span["rr"] and span["lpt"] < span["contiguous"], span
    assert span["lpt"] <= 1.2 * lower, (span, lower)
    # The planner (load-aware LPT from an idle state) places exactly like lpt().
    p = Planner(m, cm)
    ticket = p.assign([Job(i, f"k{i}", L) for i, L in enumerate(lengths)])
    placed = [a.worker for a in ticket.assignments]
    assert math.isclose(makespan(costs, placed, m), span["lpt"])
    assert math.isclose(max(p.loads()), span["lpt"])


def test_lpt_list_scheduling_bound_random(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    for _ in range(200):
        m = rng.randint(1, 8)
        costs = [rng.paretovariate(1.2) for _ in range(rng.randint(1, 40))]
        span = makespan(costs, lpt(costs, m), m)
        assert span <= sum(costs) / m + (1 - 1 / m) * max(costs) + 1e-9
        assert span >= max(max(costs), sum(costs) / m) - 1e-9


def test_planner_load_aware_across_requests() -> None:
    p = Planner(2, CostModel((0.0, 1e-3, 0.0)))
    big = p.assign([Job(0, "big", 4000)])           # 4 s on worker 0
    assert big.assignments[0].worker == 0 and math.isclose(p.load(0), 4.0)
    small = p.assign([Job(i, f"s{i}", 1000) for i in range(4)])   # 4 × 1 s
    assert [a.worker for a in small.assignments] == [1, 1, 1, 1]  # fills up to the busy one
    assert math.isclose(p.load(1), 4.0)
    nxt = p.assign([Job(0, "n", 1000)])
    assert nxt.assignments[0].worker == 0            # tie on load: fewer builds wins
    # SegmentReady of the big one: its load leaves worker 0, the cost model learns.
    assert p.complete(big, "big", tokens=4000, build_s=3.0)
    assert p.cost.n == 1 and math.isclose(p.load(0), 1.0)
    for t in (big, small, nxt):
        p.release(t)
    assert p.loads() == [0.0, 0.0] and p.inflight_keys() == {}
    # What a worker reports (Scatter.Load) counts too; a down worker gets nothing.
    p.set_external_load(0, in_flight=3, queued_tokens=3000)
    assert [a.worker for a in p.assign([Job(0, "x", 10)]).assignments] == [1]
    p.set_external_load(0, 0, 0)
    p.mark_down(1)
    assert {a.worker for a in p.assign([Job(i, f"y{i}", 10) for i in range(3)]).assignments} == {0}
    p.mark_down(0)  # every worker down: still assign (combine falls back)
    assert len(p.assign([Job(0, "z", 10)]).assignments) == 1


def test_planner_single_flight() -> None:
    p = Planner(3, CostModel((0.0, 1e-3, 0.0)))
    a = p.assign([Job(0, "K", 2000), Job(1, "A", 500)])
    wk = a.assignments[0].worker
    loads_before = p.loads()
    b = p.assign([Job(0, "B", 500), Job(1, "K", 2000), Job(2, "K", 2000)])  # K twice, in flight
    k_b = [x for x in b.assignments if x.key == "K"]
    assert all(x.worker == wk and x.shared for x in k_b)
    assert sum(p.loads()) == pytest.approx(sum(loads_before) + 0.5)  # only B added load
    # Duplicates inside one new request share one build too.
    c = p.assign([Job(0, "D", 700), Job(1, "D", 700)])
    assert c.assignments[0].worker == c.assignments[1].worker
    assert not c.assignments[0].shared and c.assignments[1].shared
    # The request that started K goes away: K stays in flight for b.
    p.release(a)
    assert p.inflight_keys()["K"] == wk
    # b's SegmentReady for K retires it and feeds the model once; a second report does not.
    assert p.complete(b, "K", tokens=2000, build_s=1.7)
    assert not p.complete(b, "K", tokens=2000, build_s=1.7)
    assert "K" not in p.inflight_keys() and p.cost.n == 1
    # A new request for K after completion is a fresh placement (segcache will have it).
    d = p.assign([Job(0, "K", 2000)])
    assert not d.assignments[0].shared
    for t in (b, c, d):
        p.release(t)
    assert p.inflight_keys() == {} and p.loads() == [0.0, 0.0, 0.0]


def test_planner_places_one_requests_misses_longest_first(fresh_seed) -> None:
    """The router's planner places a request's misses as LPT does (longest first onto the least
    loaded worker): on random skewed lengths its makespan equals lpt()'s, and on a case where
    shortest-first is worse, it is strictly better than that."""
    def planned(tokens: list[int], n_workers: int) -> tuple[list[int], list[float]]:
        p = Planner(n_workers, CostModel((0.0, 1e-3, 0.0)))  # cost = tokens / 1000
        t = p.assign([Job(i, f"k{i}", n) for i, n in enumerate(tokens)])
        return [a.worker for a in t.assignments], [n / 1000 for n in tokens]

    workers, costs = planned([100, 100, 100, 300], 2)
    assert math.isclose(makespan(costs, workers, 2), 0.3)  # shortest-first would give 0.4
    g = random.Random(fresh_seed)
    for _ in range(20):
        n_workers = g.randrange(2, 5)
        tokens = [int(g.paretovariate(1.2) * 50) + 1 for _ in range(g.randrange(3, 12))]
        workers, costs = planned(tokens, n_workers)
        want = makespan(costs, lpt(costs, n_workers), n_workers)
        assert math.isclose(makespan(costs, workers, n_workers), want), (tokens, workers)
