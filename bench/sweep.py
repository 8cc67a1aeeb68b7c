"""The QPS sweep of bench/serve.py: Poisson arrivals of one workload at rates that are multiples of
full recompute's service rate, each mode searching the rate ladder for its bracket around the TTFT
SLO, the modes' searches taking turns so that a load drifting on a shared machine moves every
mode's points alike."""
from __future__ import annotations

import math

from bench import workloads as W
from bench.driver import Encoder, PrefixReplay, drive, log, qps_at_slo, shape_trace, slim_records, summarize
from common.engine.modes import LABELS
from hypic.launcher import Mesh


def sweep_trace(wl: dict, args, p: int, rate: float) -> W.Trace:
    """The requests of sweep point p of --workload: arrivals over about --rate-window seconds (at
    least --n-rate-min, at most --n-rate-max requests), fresh draws per point (a --trace run
    replays its whole trace at every point, arrivals scaled to the rate)."""
    n = int(min(args.n_rate_max, max(args.n_rate_min, round(rate * args.rate_window))))
    return shape_trace(wl, args, args.workload, n, seed=args.seed * 1000 + 100 + p, rate=rate)


def bracket_search(start: int, n: int):
    """The ladder indices one mode runs, as a generator sent each point's verdict (True: meets the
    SLO): `start`, then up while the SLO holds, or down until it holds."""
    if (yield start):
        p = start + 1
        while p < n and (yield p):
            p += 1
    else:
        p = start - 1
        while p >= 0 and not (yield p):
            p -= 1


def interleaved(searches: dict, run) -> None:
    """Drive every mode's bracket_search in rounds, one point per mode per round, the order
    rotated each round: a baseline's points are measured next to the others' in time, so a load
    that drifts during the sweep (other jobs on a shared machine) moves them alike instead of
    deciding which mode is faster. `run(mode, p)` measures a point and returns its verdict."""
    nxt = {mode: next(g) for mode, g in searches.items()}
    rnd = 0
    while nxt:
        order = list(nxt)
        for mode in order[rnd % len(order):] + order[:rnd % len(order)]:
            try:
                nxt[mode] = searches[mode].send(run(mode, nxt[mode]))
            except StopIteration:
                del nxt[mode]
        rnd += 1


def rate_sweep(mesh: Mesh, enc: Encoder, wl: dict, closed: dict, replay: PrefixReplay, args) -> dict:
    """Per mode, a search over the rate ladder for the bracket [last rate meeting the SLO, first
    rate missing it]: start at the highest rate at or below half the mode's own closed-loop
    service rate, go up while the SLO holds, or down until it holds; the modes' searches take
    turns (`interleaved`). Every point reported was measured; the same trace is used at a given
    rate for every mode that runs it."""
    shape = args.workload
    full = closed[shape]["modes"]["full"]
    mu = 1.0 / full["ttft_mean_s"]
    slo = args.slo_x * full["ttft_p50_s"]
    xs = sorted(args.rates_x)
    rates = [x * mu for x in xs]
    log(f"\n== QPS sweep ({shape}, Poisson): full recompute serves {mu:.3f} req/s at concurrency 1; "
        f"SLO p90 TTFT <= {slo:.2f} s ({args.slo_x:g} x full's p50); rate ladder "
        f"{', '.join(f'{r:.3f}' for r in rates)} req/s")
    traces: dict[int, W.Trace] = {}
    out = {"slo_s": slo, "slo_x_full_p50": args.slo_x, "full_service_rate_rps": mu,
           "shape": shape, "rates_x": xs, "rates": rates, "window_s": args.rate_window, "interleaved": True,
           "n_per_rate": [len(sweep_trace(wl, args, p, r)) for p, r in enumerate(rates)], "modes": {}}
    points: dict[str, dict[int, dict]] = {mode: {} for mode in args.modes}
    starts = {mode: max([p for p, r in enumerate(rates) if r <= 0.5 / closed[shape]["modes"][mode]["ttft_mean_s"]],
                        default=0) for mode in args.modes}

    def run(mode: str, p: int) -> bool:
        trace = traces.setdefault(p, sweep_trace(wl, args, p, rates[p]))
        points[mode][p] = sweep_point(mesh, enc, trace, mode, replay, shape, rates[p], xs[p], slo, args)
        return points[mode][p]["meets_slo"]

    interleaved({mode: bracket_search(starts[mode], len(rates)) for mode in args.modes}, run)
    for mode in args.modes:
        pts = [points[mode][p] for p in sorted(points[mode])]
        q = qps_at_slo(pts, slo, closed[shape]["modes"][mode]["ttft_p90_s"])
        # the same points at tighter SLOs (valid: a tighter SLO is missed no later)
        q["by_slo_x"] = {f"{x:g}": qps_at_slo(pts, x * full["ttft_p50_s"],
                                              closed[shape]["modes"][mode]["ttft_p90_s"])["interpolated_qps"]
                         for x in (1.5, 2.0, 2.5, 3.0) if x <= args.slo_x}
        out["modes"][mode] = {"points": pts, "start_rate": rates[starts[mode]], **q}
        log(f"  {LABELS[mode]:<15} QPS at SLO: {q['interpolated_qps']:.3f} (interpolated), "
            f"{q['measured_qps']:.3f} (highest passing rate){' (lower bound)' if q['lower_bound'] else ''}")
    return out


def sweep_point(mesh: Mesh, enc: Encoder, trace: W.Trace, mode: str, replay: PrefixReplay, shape: str,
                rate: float, rate_x: float, slo: float, args) -> dict:
    """One point of the sweep: `trace` sent open loop at its arrival times in `mode`."""
    reused = [replay.request(shape, r) for r in trace.requests] if mode == "prefix" else None
    recs, wall = drive(mesh.router_address, trace.requests, mode, enc, max_tokens=args.max_tokens, open_loop=True)
    s = summarize(recs, wall, reused)
    ok = s["ttft_p90_s"] <= slo and not s["errors"]
    log(f"  {LABELS[mode]:<15} rate {rate:6.3f} req/s ({len(trace):>2} req)  TTFT p50 "
        f"{s['ttft_p50_s']*1e3:7.0f}  p90 {s['ttft_p90_s']*1e3:7.0f} ms  "
        f"{'meets' if ok else 'MISSES'} SLO  ({wall:.1f} s)"
        + (f"  ERRORS {s['errors']}: {s['errors_sample'][:1]}" if s["errors"] else ""))
    return dict(rate=rate, rate_x=rate_x, n=len(trace), ttft_p50_s=s["ttft_p50_s"],
                ttft_p90_s=s["ttft_p90_s"] if not s["errors"] else math.inf,
                ttft_p99_s=s["ttft_p99_s"], itl_mean_s=s["itl_mean_s"],
                throughput_rps=s["throughput_rps"], hit_rate=s["hit_rate"],
                hits_by_tier=s["hits_by_tier"], errors=s["errors"],
                errors_sample=s["errors_sample"], wall_s=wall, meets_slo=ok,
                # per request: what waiting under load was made of (server TTFT against the
                # combine's own prefill time, query_s, for the baselines)
                records=slim_records(recs))
