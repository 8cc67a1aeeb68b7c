"""Does the shadow recompute delay users' requests? (issue 26, docs/drift.md)

    nice python -m bench.shadow [--requests 120 --blocks 4 --concurrency 4 --rate 0.1]   # ~4 min

One mesh on the bundled model (segcache, one scatter, one combine, torch threads=1 each) with two
routers in front of the same workers: one with --shadow-rate 0, one with --shadow-rate RATE (the
drift guard off in both, so the seam stays --seam). A warm-up sends every request once through
each router (max_tokens 1): the caches are warm, as in a long-running server. Then the same RAG
requests go through both routers in a closed loop of --concurrency clients, block by block, the
order of the two routers alternating between blocks so that a drift in the machine's load falls
on both; after each block through the sampling router, its shadow queue is left to drain (the
shadows run while combine is idle) before the next block starts. TTFT is the client's (SDK
receipt of the first token). Writes bench/results/shadow.json: TTFT p50/p90/p99 per rate, their
ratios (RATE over 0), and the sampling router's shadow counts (sampled, shadowed, dropped by
reason) and rolling figures over the measured blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families

import hypic
from bench import workloads as W
from bench.driver import Encoder, drive, json_default, log, summarize
from hypic.launcher import DEFAULT_MODEL, Mesh
from hypic.processes import Service, free_port

RESULTS = Path(__file__).resolve().parent / "results"
ROUTER_FLAGS = ["--no-drift-guard"]  # a fixed seam: the comparison is of the shadow's cost alone
SUMMARY_KEYS = ("n", "errors", "errors_sample", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
                "server_ttft_p50_s", "itl_p50_s", "e2e_p50_s", "throughput_rps", "hit_rate")


def start_sampling_router(mesh: Mesh, rate: float, metrics_port: int) -> Service:
    """A second router over the mesh's workers, sampling at `rate` (stopped by the caller)."""
    args = mesh.service_args("router", segcache=mesh.segcache_address, scatter=mesh.scatter_addresses,
                             combine=mesh.combine_addresses)
    svc = Service(name="router_shadow", kind="router", run_dir=mesh.run_dir, log_dir=mesh.log_dir,
                  args=args + ROUTER_FLAGS + ["--shadow-rate", str(rate), "--metrics-port", str(metrics_port)],
                  host=mesh.host)
    svc.start()
    svc.wait_ready(time.monotonic() + 180)
    return svc


def shadow_counts(address: str, metrics_port: int) -> dict:
    """The router's DriftSummary, with its dropped shadows by reason (from its /metrics)."""
    with hypic.Client(address, timeout=30) as c:
        out = asdict(c.info().drift)
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    out["dropped_by_reason"] = {s.labels["reason"]: s.value for fam in text_string_to_metric_families(body)
                                for s in fam.samples if s.name == "hypic_shadow_dropped_total"}
    return out


def drain(address: str, metrics_port: int, timeout_s: float = 60.0) -> dict:
    """Wait until every sampled request's shadow is computed or dropped; the counts then."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = shadow_counts(address, metrics_port)
        if c["shadowed"] + c["dropped"] >= c["sampled"] or time.monotonic() > deadline:
            return c
        time.sleep(0.1)


def delta(after: dict, before: dict) -> dict:
    """The counts of the measured blocks alone (the warm-up's subtracted)."""
    out = {k: after[k] - before[k] for k in ("sampled", "shadowed", "dropped", "over_threshold")}
    out["dropped_by_reason"] = {r: v - before["dropped_by_reason"].get(r, 0.0)
                                for r, v in after["dropped_by_reason"].items()}
    out.update({k: after[k] for k in ("sample_rate", "window", "kl_mean", "top1_rate", "agreement_mean")})
    return out


def measure(args, trace: W.Trace, enc: Encoder) -> dict:
    reqs = trace.requests
    blocks = [reqs[i::args.blocks] for i in range(args.blocks)]
    records: dict[str, list[dict]] = {"0": [], str(args.rate): []}
    with tempfile.TemporaryDirectory() as data, \
            Mesh(args.model, data, n_scatter=1, threads=1, start_timeout_s=240,
                 extra_args={"router": ROUTER_FLAGS + ["--shadow-rate", "0"]}) as mesh:
        port = free_port()
        sampling = start_sampling_router(mesh, args.rate, port)
        routers = {"0": mesh.router_address, str(args.rate): sampling.address}
        try:
            for name, address in routers.items():  # warm caches and code paths, both routers
                recs, wall = drive(address, reqs, "hypic", enc, max_tokens=1, concurrency=2)
                log(f"  warm-up via rate {name}: {len(recs)} requests in {wall:.1f} s")
            before = drain(sampling.address, port)
            wall_by = {name: 0.0 for name in routers}
            for b, block in enumerate(blocks):
                order = list(routers) if b % 2 == 0 else list(reversed(routers))
                for name in order:
                    recs, wall = drive(routers[name], block, "hypic", enc, max_tokens=args.max_tokens,
                                       concurrency=args.concurrency)
                    records[name] += recs
                    wall_by[name] += wall
                    if name != "0":
                        drain(sampling.address, port)
                log(f"  block {b + 1}/{len(blocks)}: {len(block)} requests per rate")
            counts = delta(drain(sampling.address, port), before)
        finally:
            sampling.signal(15)
            sampling.wait(15)
    return {"records": records, "walls": wall_by, "shadows": counts}


def table(rates: dict, ratios: dict) -> str:
    rows = [f"{'shadow rate':>12} {'n':>5} {'TTFT p50 ms':>12} {'p90 ms':>8} {'p99 ms':>8} {'req/s':>7}"]
    for name, s in rates.items():
        rows.append(f"{name:>12} {s['n']:>5} {s['ttft_p50_s'] * 1e3:>12.1f} {s['ttft_p90_s'] * 1e3:>8.1f} "
                    f"{s['ttft_p99_s'] * 1e3:>8.1f} {s['throughput_rps']:>7.2f}")
    rows.append(f"{'ratio':>12} {'':>5} {ratios['ttft_p50']:>12.3f} {ratios['ttft_p90']:>8.3f} "
                f"{ratios['ttft_p99']:>8.3f} {ratios['throughput']:>7.3f}")
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.shadow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rate", type=float, default=0.1, help="the sampling router's --shadow-rate")
    ap.add_argument("--requests", type=int, default=120, help="RAG requests (each sent at both rates)")
    ap.add_argument("--blocks", type=int, default=4, help="alternating blocks the requests are sent in")
    ap.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--corpus", type=int, default=48, help="documents in the RAG corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "shadow.json")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    enc = Encoder(args.model)
    corpus = W.make_corpus(args.corpus, (128, 512), seed=args.seed * 1000 + 1)
    trace = W.rag_trace(corpus, args.requests, seed=args.seed * 1000 + 20, k=(2, 6), max_prompt_tokens=2048)
    log(f"== shadow recompute under load: {args.requests} RAG requests x rates 0 and {args.rate}, "
        f"concurrency {args.concurrency}, {args.blocks} alternating blocks")
    got = measure(args, trace, enc)
    rates = {name: {k: v for k, v in summarize(recs, got["walls"][name]).items() if k in SUMMARY_KEYS}
             for name, recs in got["records"].items()}
    base, sampled = rates["0"], rates[str(args.rate)]
    ratios = {f"ttft_p{q}": sampled[f"ttft_p{q}_s"] / base[f"ttft_p{q}_s"] for q in (50, 90, 99)}
    ratios["throughput"] = sampled["throughput_rps"] / base["throughput_rps"]
    print(table(rates, ratios))
    sh = got["shadows"]
    print(f"shadows at rate {args.rate}: {sh['sampled']} sampled, {sh['shadowed']} computed, "
          f"{sh['dropped']} dropped {sh['dropped_by_reason']}; rolling KL {sh['kl_mean']:.4f} nats, "
          f"top-1 {sh['top1_rate']:.2f}, agreement {sh['agreement_mean']:.2f}")
    res = dict(what=__doc__.split("\n\n", 2)[2].strip(),
               command=" ".join(["python -m bench.shadow", *(sys.argv[1:] if argv is None else argv)]),
               model=str(args.model.name), trace=trace.summary(), rate=args.rate, concurrency=args.concurrency,
               max_tokens=args.max_tokens, blocks=args.blocks, ttft_by_rate=rates, ratio_vs_rate_0=ratios,
               shadows=sh, loadavg=os.getloadavg(), cpus=os.cpu_count(), platform=platform.platform(),
               wall_s=time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=json_default) + "\n")
    log(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
