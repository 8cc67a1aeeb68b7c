"""bench/sweep.py's search over the rate ladder: each mode's bracket found as by a plain loop, and
the modes taking turns (one point each per round, the order rotated) rather than one after the other."""
from __future__ import annotations

import random

import pytest

from bench.sweep import bracket_search, interleaved


def plain_bracket(start: int, n: int, meets) -> list[int]:
    """The reference: the loop bench.serve ran before the searches were interleaved."""
    ran = [start]
    if meets(start):
        p = start + 1
        while p < n:
            ran.append(p)
            if not meets(p):
                break
            p += 1
    else:
        p = start - 1
        while p >= 0:
            ran.append(p)
            if meets(p):
                break
            p -= 1
    return ran


@pytest.mark.parametrize("seed", range(30))
def test_interleaved_searches_run_the_points_a_plain_loop_would(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    modes = ["full", "prefix", "hypic"][:rng.randint(1, 3)]
    # a capacity per mode (rate index it still meets the SLO at), plus a noisy non-monotonic point
    cap = {m: rng.randint(-1, n) for m in modes}
    noisy = {m: rng.randrange(n) for m in modes}
    meets = {m: (lambda p, m=m: (p <= cap[m]) != (p == noisy[m] and seed % 3 == 0)) for m in modes}
    starts = {m: rng.randrange(n) for m in modes}
    log: list[tuple[str, int]] = []

    def run(mode, p):
        log.append((mode, p))
        return meets[mode](p)

    interleaved({m: bracket_search(starts[m], n) for m in modes}, run)
    for m in modes:
        assert [p for mm, p in log if mm == m] == plain_bracket(starts[m], n, meets[m]), m
    # turns: before any mode's k-th point, every mode still searching has run its (k-1)-th
    seen = {m: 0 for m in modes}
    for m, _ in log:
        seen[m] += 1
        total = {mm: sum(1 for x, _ in log if x == mm) for mm in modes}
        assert all(seen[m] - 1 <= seen[o] or total[o] < seen[m] for o in modes)


def test_the_order_rotates_each_round():
    order: list[str] = []

    def run(mode, p):
        order.append(mode)
        return True  # everyone climbs to the top of a 3-rung ladder from 0: 3 rounds

    interleaved({m: bracket_search(0, 3) for m in ("a", "b", "c")}, run)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
