"""Warm-up until the segment hit rate stops rising (`bench.serve --steady`).

A short warm-up leaves a server's caches far from where a long-running one keeps them: with a
Zipf-popular corpus every round of fresh requests still finds documents never seen before, fewer
each round. A ratio measured after such a warm-up is the cold start's, not the steady state's.
Here the warm-up runs in rounds of fresh requests (same corpus and popularity, a new seed per
round), every cache-using mode on the same requests, and stops once hypic's hit rate has stopped
rising: the curve (each round's hit rate) is the evidence, reported beside the results.

The rule (`SteadyRule.plateaued`): stop after round k when the mean hit rate of the last
`patience` rounds is not above the mean of the `patience` rounds before them by more than `eps`.
A round's rate is noisy (a few dozen lookups); comparing means of rounds, not a round against the
best one before it (a maximum of noisy values, biased high), keeps noise from ending the warm-up
while the rate still rises. At most `max_rounds` rounds: a run that gets there says it did not
reach the plateau. bench.serve draws round k's requests with seed 1000 s + 500 + k, so at most
MAX_ROUNDS rounds: more would draw the requests of the next seed's workloads.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from bench.driver import drive, summarize

MAX_ROUNDS = 500  # round seeds 1000 s + 500 .. 1000 s + 999 (bench/serve.py): within seed s's block


@dataclass(frozen=True)
class SteadyRule:
    round_requests: int = 8
    eps: float = 0.02  # hit rate, absolute (0.02 = 2 points)
    patience: int = 2
    max_rounds: int = 12

    def __post_init__(self):
        if self.round_requests < 1 or self.patience < 1 or self.eps < 0 \
                or not 2 * self.patience <= self.max_rounds <= MAX_ROUNDS:
            raise ValueError(f"bad steady-state rule {self}")

    def plateaued(self, rates: list[float]) -> bool:
        """Whether the hit rates of the rounds so far have stopped rising."""
        p = self.patience
        if len(rates) < 2 * p:
            return False
        return sum(rates[-p:]) / p <= sum(rates[-2 * p:-p]) / p + self.eps


def warm_until_steady(address: str, enc, make_round: Callable[[int], object], modes: list[str],
                      rule: SteadyRule, replay_prefix: Callable[[object], list[int]] | None = None,
                      log: Callable[[str], None] = print, label: str = "") -> dict:
    """Rounds of `make_round(k)` (a bench.workloads.Trace of rule.round_requests requests) in every
    mode of `modes` (the cache-using ones, hypic among them; concurrency 2, one token each) until
    hypic's hit rate plateaus: its rate and tiers as bench.driver.summarize counts them.
    replay_prefix(trace): the segments each request of the round reuses from the prefix cache
    (its client-side replay, called after the prefix-mode round). Returns the curve and whether the
    plateau was reached."""
    if "hypic" not in modes:
        raise ValueError("the steady state is hypic's hit rate: --modes must include hypic")
    curve: list[dict] = []
    rates: list[float] = []
    t0 = time.perf_counter()
    for k in range(rule.max_rounds):
        trace = make_round(k)
        point: dict = dict(round=k + 1, requests=(k + 1) * len(trace.requests))
        for mode in modes:
            recs, wall = drive(address, trace.requests, mode, enc, max_tokens=1, concurrency=2)
            errs = [r["error"] for r in recs if "error" in r]
            if errs:
                log(f"  steady warm-up {label} round {k + 1} {mode}: {len(errs)} errors, e.g. {errs[0]}")
            if mode == "hypic":
                s = summarize(recs, wall)
                point.update(hit_rate=s["hit_rate"], hits_by_tier=s["hits_by_tier"], wall_s=wall, errors=len(errs))
            elif mode == "prefix" and replay_prefix is not None:
                point["prefix_hit_rate"] = summarize(recs, wall, prefix_reused=replay_prefix(trace))["hit_rate"]
        rates.append(point["hit_rate"] if point["hit_rate"] is not None else 0.0)
        curve.append(point)
        log(f"  steady warm-up {label} round {k + 1}: {point['requests']} requests, hypic hit rate "
            f"{rates[-1]:.0%} ({point['wall_s']:.1f} s)")
        if rule.plateaued(rates):
            break
    return dict(rule=asdict(rule), curve=curve, reached=rule.plateaued(rates), rounds=len(curve),
                requests_per_mode=curve[-1]["requests"], wall_s=time.perf_counter() - t0)
