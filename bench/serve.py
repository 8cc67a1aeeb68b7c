"""Serving benchmark: drives the running mesh through the SDK (the way `vllm bench serve` drives a
server) and compares full recompute, prefix cache, additive PIC and hypic side by side on the same
requests.

    python -m bench.serve                        # bundled model, the whole run (<= 15 min)
    python -m bench.serve --model DIR --quick    # a smoke run (any checkpoint; token ids when it
                                                 # has no tokenizer)
    python -m bench.serve --workload chat --shapes chat   # the sweep on another of the five
                                                 # workloads -> serve_chat.json
    python -m bench.serve --trace FILE.jsonl     # the user's own trace (bench/trace.py) as the workload
    python -m bench.serve --base-url http://127.0.0.1:8000 [--trace FILE.jsonl]
                                                 # a running deployment through its OpenAI front
                                                 # (--address HOST:PORT: through gRPC); bench/remote.py

What one run does (every number in bench/results/serve.json and cold.json comes from it):
1. Starts the mesh as processes (hypic.launcher.Mesh: segcache, scatter x2, combine, router;
   torch threads=1 per process). segcache's host tier is capped (--host-bytes) below the size of
   the corpus's entries, so the tail of the corpus is served from its LMDB tier.
2. Warm-up, so that the caches are in the state of a long-running server: one small request per
   mode (code paths), then a warm-up trace per shape (same corpus and popularity, another seed)
   sent in every cache-using mode (prefix, additive, hypic): the popular documents are cached, the
   tail is not, and the prefix cache has seen earlier requests.
3. Closed loop (concurrency 1) per shape (RAG, summarization, agent, chat, few-shot; --shapes):
   every mode on the same request list -> TTFT p50/p90/p99, inter-token latency, throughput, hit
   rates per tier.
4. QPS sweep (--workload, RAG by default; Poisson arrivals): rates are multiples of full recompute's service rate on
   this machine (1 / its mean closed-loop TTFT); every mode gets the same requests at each rate
   (fresh ones per rate); a mode's sweep stops at its first rate whose p90 TTFT misses the SLO;
   the modes' searches take turns, one point each per round (bench/sweep.py).
   SLO = --slo-x times full recompute's closed-loop p50 TTFT (that workload) on this machine. QPS at SLO:
   the highest rate whose p90 TTFT <= SLO, measured (highest passing rate) and interpolated
   linearly between the last passing and the first failing rate (rate 0 = the closed-loop p90).
5. Cold path (bench/cold_mesh.py): fresh documents on m = 2, then m = 1 scatter workers; simulated
   m = 1, 2, 4, 8 and LPT vs round-robin vs contiguous partitioning on a 32k-token request.

Prefix-cache hit rates are not reported by the combine, so they come from a client-side replay of
its cache (segment-aligned prefixes, LRU of --prefix-cache-bytes with state sizes from the model
config) over the prefix-mode requests in the order they were sent.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import remote, results_json
from bench import trace as TR
from bench import workloads as W
from bench.cold_mesh import ColdParams, cold_path
from bench.driver import (ROOT, Encoder, PrefixReplay, build_workloads, drive, json_default, log, shape_trace,
                          slim_records, summarize)
from bench.plots import plot_cdf, plot_cold, plot_rate
from bench.steady import SteadyRule, warm_until_steady
from bench.sweep import rate_sweep
from bench.report_baseline import named, vs_best
from bench.random_model import RANDOM_LABEL, describe, parse_spec, save_random_model
from common.engine.modes import LABELS, MODES
from hypic.launcher import DEFAULT_MODEL, Mesh

CACHED_MODES = tuple(m for m in MODES if m != "full")  # prefix, additive, hypic
SHAPES = W.SHAPES



def warm_up(mesh: Mesh, enc: Encoder, wl: dict, replay: PrefixReplay, args) -> dict:
    t0 = time.perf_counter()
    rng = random.Random(args.seed + 99)
    tiny = W.Request(0, 0.0, [W.make_document(rng, -1, 24).words, W.make_document(rng, -2, 24).words],
                     ("<q>", "find", W.KEYS[0], "<a>"), [-1, -2])
    for mode in args.modes:  # code paths (first calls, channel set-up)
        recs, _ = drive(mesh.router_address, [tiny], mode, enc, max_tokens=2)
        if "error" in recs[0]:
            raise RuntimeError(f"warm-up request failed in mode {mode}: {recs[0]['error']}")
        if mode == "prefix":
            replay.request("tiny", tiny)
    counts = {}
    steady = {}
    for shape, trace in wl["warm"].items():
        if args.steady:  # rounds until hypic's hit rate stops rising (bench/steady.py), not one trace
            steady[shape] = warm_until_steady(
                mesh.router_address, enc, lambda k, shape=shape: shape_trace(wl, args, shape, args.steady_round,
                                                                            seed=args.seed * 1000 + 500 + k),
                [m for m in args.modes if m in CACHED_MODES], SteadyRule(args.steady_round, args.steady_eps,
                                                                          args.steady_patience, args.steady_max_rounds),
                replay_prefix=lambda tr, shape=shape: [replay.request(shape, r) for r in tr.requests],
                log=log, label=shape)
            counts[shape] = steady[shape]["requests_per_mode"]
            continue
        for mode in (m for m in args.modes if m in CACHED_MODES):
            recs, wall = drive(mesh.router_address, trace.requests, mode, enc, max_tokens=1,
                               concurrency=2)
            if mode == "prefix":
                for r in trace.requests:
                    replay.request(shape, r)
            errs = [r["error"] for r in recs if "error" in r]
            if errs:
                log(f"  warm-up {shape}/{mode}: {len(errs)} errors, e.g. {errs[0]}")
            log(f"  warm-up {shape:<13} {mode:<7} {len(recs)} requests in {wall:.1f} s")
        counts[shape] = len(trace)
    distinct = {shape: len({d for r in tr.requests for d in r.doc_ids}) for shape, tr in wl["warm"].items()
                if shape not in steady}
    out = dict(requests=counts, distinct_segments=distinct, wall_s=time.perf_counter() - t0,
               what="one 2-segment request per mode (code paths), then per shape a warm-up trace "
                    "(same corpus/pools and popularity, another seed) in prefix, additive and hypic "
                    "at concurrency 2, max_tokens 1")
    if steady:
        out.update(steady=steady, what="one 2-segment request per mode (code paths), then per shape rounds of "
                   f"{args.steady_round} fresh requests (same corpus/pools and popularity, a new seed each) in "
                   "every cache-using mode at concurrency 2, max_tokens 1, until hypic's hit rate stopped rising")
    return out


def closed_loop(mesh: Mesh, enc: Encoder, wl: dict, replay: PrefixReplay, args) -> dict:
    out = {}
    for shape in wl["closed"]:
        trace = wl["closed"][shape]
        out[shape] = {"trace": trace.summary(), "modes": {}}
        log(f"\n== {shape}: {len(trace)} requests, concurrency {args.concurrency}, "
            f"{trace.summary()['segments_mean']:.1f} segments / "
            f"{trace.summary()['prompt_tokens_mean']:.0f} tokens per prompt on average")
        for mode in args.modes:
            reused = [replay.request(shape, r) for r in trace.requests] if mode == "prefix" else None
            recs, wall = drive(mesh.router_address, trace.requests, mode, enc,
                               max_tokens=args.max_tokens, concurrency=args.concurrency)
            s = summarize(recs, wall, reused)
            s["ttft_s"] = sorted(r["ttft_s"] for r in recs if "ttft_s" in r)
            s["records"] = slim_records(recs)
            out[shape]["modes"][mode] = s
            log(_row(mode, s))
    return out


def _row(mode: str, s: dict) -> str:
    hr = s.get("hit_rate")
    tiers = ", ".join(f"{t} {v:.0%}" for t, v in s.get("hits_by_tier", {}).items())
    return (f"  {LABELS[mode]:<15} TTFT p50 {s['ttft_p50_s']*1e3:7.0f}  p90 {s['ttft_p90_s']*1e3:7.0f}  "
            f"p99 {s['ttft_p99_s']*1e3:7.0f} ms   ITL {s['itl_mean_s']*1e3:5.1f} ms   "
            f"{s['throughput_rps']:.2f} req/s {s['output_tok_s']:.1f} tok/s   "
            f"hits {'-' if hr is None else f'{hr:.0%}'}{f' ({tiers})' if tiers else ''}"
            + (f"   ERRORS {s['errors']}: {s['errors_sample'][:1]}" if s["errors"] else ""))


def headline(serve: dict, cold: dict | None) -> dict:
    """The run's headline: hypic against the best baseline at each point (vs_best_baseline:
    the faster of full recompute and prefix cache, named), each mode's QPS at the SLO, and the
    cold path. No ratio against a fixed baseline: one against the slower would overstate."""
    h: dict = dict(shape=serve["shape"])
    sw = serve.get("sweep")
    if sw:
        h["slo_s"] = sw["slo_s"]
        h["qps_at_slo"] = {m: d["interpolated_qps"] for m, d in sw["modes"].items()}
        if "hypic" in sw["modes"]:
            h["qps_hypic_lower_bound"] = sw["modes"]["hypic"]["lower_bound"]
    if cold:
        h["cold_speedup_m2"] = cold["measured"]["speedup_m2"]
        rows = cold["simulated"]["rows"]
        big = max(r["m"] for r in rows)
        h["sim_m"] = big
        h["sim_speedup"] = {r["partition"]: r["speedup_vs_m1"] for r in rows if r["m"] == big}
        h["sim_build_speedup"] = {r["partition"]: r["makespan_speedup_vs_m1"] for r in rows if r["m"] == big}
        h["sim_speedup_by_m"] = {r["partition"]: {str(x["m"]): x["speedup_vs_m1"] for x in rows
                                                  if x["partition"] == r["partition"]}
                                 for r in rows}
    # every ratio against the better of full recompute and prefix cache at its point, named
    h["vs_best_baseline"] = vs_best(serve)
    return h


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--random-model", default="", metavar="SPEC",
                    help="serve a random-weight model of this shape instead, e.g. hidden=1024,layers=16,ratio=3:1 "
                         "(bench.random_model; timing only, labelled so; output files get the tag _random)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes everywhere")
    ap.add_argument("--n-scatter", type=int, default=2)
    ap.add_argument("--host-bytes", default="48MiB", help="segcache host-tier budget")
    ap.add_argument("--segcaches", type=int, default=1, help="segcache instances (host-bytes each); "
                    "bench/serve_cache.py compares 1 vs k vs 1 + the shared tier")
    ap.add_argument("--remote-tier", action="store_true", help="a Mooncake master as every "
                    "segcache's shared tier")
    ap.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                    help="the combine's prefix cache budget (common.engine.pic.prefix.PrefixCache default)")
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--corpus", type=int, default=160, help="RAG corpus size (documents)")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[128, 2048])
    ap.add_argument("--k", type=int, nargs=2, default=[4, 32])
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--summ-pool", type=int, default=24)
    ap.add_argument("--summ-tokens", type=int, nargs=2, default=[768, 2048])
    ap.add_argument("--n-warm", type=int, default=8, help="RAG warm-up requests per cached mode")
    ap.add_argument("--n-closed", type=int, default=16, help="RAG closed-loop requests per mode")
    ap.add_argument("--n-summ", type=int, default=6)
    ap.add_argument("--n-agent", type=int, default=12)
    ap.add_argument("--n-chat", type=int, default=12)
    ap.add_argument("--n-fewshot", type=int, default=12)
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                    help="workload shapes of the warm-up and closed loop")
    ap.add_argument("--workload", choices=SHAPES, default="rag",
                    help="the shape of the QPS sweep and the headline (a shape other than rag tags "
                         "the output files _<workload> unless --tag is given)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="prefill modes to run (full and prefix at least: the SLO and the baselines; "
                         "the ratios need hypic too)")
    ap.add_argument("--no-plots", action="store_true", help="write the JSON only")
    ap.add_argument("--steady", action="store_true", help="warm up in rounds until hypic's segment hit rate "
                    "stops rising (bench/steady.py) instead of one --n-warm trace; the curve goes in the JSON")
    ap.add_argument("--steady-round", type=int, default=8, help="requests per steady warm-up round")
    ap.add_argument("--steady-eps", type=float, default=0.02, help="the hit rate still rises while the mean of "
                    "the last --steady-patience rounds beats the mean of those before them by more than this")
    ap.add_argument("--steady-patience", type=int, default=2, help="rounds per mean compared")
    ap.add_argument("--steady-max-rounds", type=int, default=12, help="at most 500 (bench/steady.py: the round seeds)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rate-window", type=float, default=15.0,
                    help="seconds of arrivals per sweep point (requests = rate x window, clamped)")
    ap.add_argument("--n-rate-min", type=int, default=10)
    ap.add_argument("--n-rate-max", type=int, default=160)
    ap.add_argument("--rates-x", type=float, nargs="+",
                    default=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                    help="the rate ladder, as multiples of full recompute's service rate")
    ap.add_argument("--slo-x", type=float, default=3.0, help="SLO = this x full recompute's p50 TTFT")
    ap.add_argument("--cold-tokens", type=int, default=ColdParams.cold_tokens)
    ap.add_argument("--cold-reps", type=int, default=ColdParams.cold_reps)
    ap.add_argument("--sim-tokens", type=int, default=ColdParams.sim_tokens)
    ap.add_argument("--sim-m", type=int, nargs="+", default=list(ColdParams.sim_m))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=None, help="mesh data dir (default: a fresh temp dir)")
    ap.add_argument("--tag", default="", help="suffix of the output files (serve<tag>.json ...)")
    # a running deployment instead of a mesh of our own (bench/remote.py)
    ap.add_argument("--base-url", default="", help="benchmark this OpenAI-compatible front "
                    "(http://host:port) instead of starting a mesh")
    ap.add_argument("--address", default="", help="benchmark this router (host:port) over gRPC")
    ap.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace (bench/trace.py; "
                    "bench/README.md) as the workload: against our own mesh, a closed loop in "
                    "every mode then the QPS sweep with its arrivals scaled to each rate; against "
                    "--base-url / --address, once at its own arrival times")
    ap.add_argument("--write-trace", type=Path, default=None, metavar="FILE",
                    help="write the --workload's closed-loop requests as a JSONL trace (bench/trace.py) and exit")
    ap.add_argument("--trace-rate", type=float, default=None, help="Poisson arrivals (req/s) of --write-trace")
    ap.add_argument("--mode", default="hypic", help="prefill mode of the --base-url/--address run")
    ap.add_argument("--api-key", default="unused", help="the front's API key (--base-url)")
    ap.add_argument("--served-model", default="", help="model id at --base-url (default: the first)")
    return settle_args(ap, ap.parse_args(argv))


def settle_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The options' consequences: a --trace run's workload and tag, the checks, --quick's sizes."""
    if args.trace is not None and not (args.base_url or args.address):
        args.workload, args.shapes, args.tag = "trace", ["trace"], args.tag or "_trace"
    elif args.workload not in args.shapes:
        ap.error("--shapes must include the --workload (the sweep and the headline are its)")
    if not {"full", "prefix"} <= set(args.modes):  # without hypic: the baselines side by side, no ratios
        ap.error("--modes must include full and prefix")
    args.modes = [m for m in MODES if m in args.modes]
    if args.steady:
        if "hypic" not in args.modes:
            ap.error("--steady warms up until hypic's hit rate stops rising: --modes must include hypic")
        try:
            SteadyRule(args.steady_round, args.steady_eps, args.steady_patience, args.steady_max_rounds)
        except ValueError as e:
            ap.error(f"--steady-*: {e}")
    if not args.tag and args.workload != "rag":
        args.tag = f"_{args.workload}"
    if args.quick:
        args.corpus, args.doc_tokens, args.summ_pool, args.summ_tokens = 24, [16, 128], 6, [64, 192]
        args.max_prompt_tokens, args.n_warm, args.n_closed, args.n_summ, args.n_agent = 512, 4, 4, 2, 4
        args.n_rate_min, args.n_rate_max, args.rate_window = 4, 8, 2.0
        args.rates_x, args.cold_tokens, args.cold_reps = [0.5, 1.0, 2.0], 600, 1
        args.max_tokens, args.host_bytes, args.n_chat, args.n_fewshot = 4, "1MiB", 4, 4
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.write_trace:
        closed = build_workloads(args)["closed"][args.workload]
        timed = W.with_arrivals(closed, args.trace_rate, args.seed) if args.trace_rate else closed
        log(f"wrote {TR.write(args.write_trace, timed, args.max_tokens)}: {len(timed)} {args.workload} requests")
        return {"trace": str(args.write_trace), "n": len(timed)}
    if args.base_url or args.address:
        return remote.main(args, argv if argv is not None else sys.argv[1:])
    t_start = time.perf_counter()
    random_dir = None
    if args.random_model:
        spec = parse_spec(args.random_model)
        random_dir = Path(tempfile.mkdtemp(prefix="hypic-random-model-"))
        args.model = save_random_model(spec, random_dir / "model", tokenizer_from=DEFAULT_MODEL)
        args.tag = args.tag or "_random"
        log(f"model: {describe(spec)}")
    try:
        return _main(args, argv, t_start)
    finally:
        if random_dir is not None:
            shutil.rmtree(random_dir, ignore_errors=True)


def run_phases(args, model: Path, enc: Encoder, wl: dict, replay: PrefixReplay, data_dir: Path) -> dict:
    """Start the mesh and run its phases: warm-up, closed loop, QPS sweep, cold path. Returns
    each phase's result and wall time."""
    phases: dict[str, float] = {}
    out: dict[str, Any] = dict(sweep=None, cold=None, phases=phases)

    def timed_phase(name: str, fn, *fn_args):
        t = time.perf_counter()
        result = fn(*fn_args)
        phases[name] = time.perf_counter() - t
        return result

    t = time.perf_counter()
    with Mesh(model, data_dir, n_scatter=args.n_scatter, threads=1, start_timeout_s=300,
              n_segcache=args.segcaches, remote_tier=args.remote_tier,
              extra_args={"segcache": ["--host-bytes", str(args.host_bytes)],
                          "router": ["--max-prompt-tokens", str(max(32768, args.sim_tokens))]}) as mesh:
        phases["mesh_start_s"] = time.perf_counter() - t
        log(f"mesh up in {phases['mesh_start_s']:.1f} s: {mesh.addresses}")
        out["warm"] = timed_phase("warm_up_s", warm_up, mesh, enc, wl, replay, args)
        out["closed"] = timed_phase("closed_loop_s", closed_loop, mesh, enc, wl, replay, args)
        if not args.no_sweep:
            out["sweep"] = timed_phase("sweep_s", rate_sweep, mesh, enc, wl, out["closed"], replay, args)
        if not args.no_cold and args.n_scatter >= 2:
            out["cold"] = timed_phase("cold_s", cold_path, mesh, enc, args)
    return out


def _main(args, argv, t_start: float) -> dict:
    model = Path(args.model)
    if not (model / "config.json").exists():
        sys.exit(f"no model at {model} (config.json missing); pass --model DIR")
    enc = Encoder(model)
    wl = build_workloads(args)
    corpus_tokens = sum(d.n_tokens for d in wl["corpus"])
    log(f"model {model} ({'text' if enc.text else 'token ids'}); RAG corpus {len(wl['corpus'])} docs, "
        f"{corpus_tokens} tokens; prompts capped at {args.max_prompt_tokens} tokens")
    load0 = os.getloadavg()
    replay = PrefixReplay(enc, args.prefix_cache_bytes)
    tmp = None if args.data_dir is not None else tempfile.mkdtemp(prefix="hypic-bench-serve-")
    try:
        run = run_phases(args, model, enc, wl, replay, args.data_dir or Path(tmp))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t_start
    phases, cold = run["phases"], run["cold"]
    phases["total_s"] = wall
    cfg = enc.cfg
    serve = dict(
        command="python -m bench.serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        model=_model_label(args, model),
        random_weights=RANDOM_LABEL if args.random_model else None,
        model_type=cfg.get("model_type"), layer_types=cfg.get("layer_types"),
        payload="text" if enc.text else "token ids",
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_start=load0,
                     loadavg_end=os.getloadavg(), torch_threads_per_process=1, n_scatter=args.n_scatter,
                     n_combine=1, segcache_host_bytes=args.host_bytes),
        params={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        workload=dict(corpus_docs=len(wl["corpus"]), corpus_tokens=corpus_tokens,
                      doc_tokens=args.doc_tokens, k=args.k, zipf_s=args.zipf_s,
                      max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                      summ_pool=len(wl["pool"]), summ_tokens=args.summ_tokens),
        shape=args.workload, warm_up=run["warm"], closed=run["closed"], sweep=run["sweep"], phases_s=phases, wall_s=wall,
        prefix_replay=dict(max_bytes=args.prefix_cache_bytes, bytes_at_end=replay.bytes,
                           entries_at_end=len(replay.items)),
    )
    serve["headline"] = headline(serve, cold)
    write_results(args, serve, cold)
    return serve


def write_results(args, serve: dict, cold: dict | None) -> None:
    """serve<tag>.json and its figures, cold<tag>.json and its figure, and the closing note."""
    args.out.mkdir(parents=True, exist_ok=True)
    tag, sweep = args.tag, serve["sweep"]
    (args.out / f"serve{tag}.json").write_text(results_json.dumps(serve, default=json_default))
    if not args.no_plots:
        plot_cdf(serve["closed"], args.out / f"serve{tag}_ttft_cdf.png")
    if sweep and not args.no_plots:
        plot_rate(sweep, args.out / f"serve{tag}_ttft_vs_rate.png")
    if cold:
        cold["command"] = serve["command"]
        cold["model"] = serve["model"]
        (args.out / f"cold{tag}.json").write_text(results_json.dumps(cold, default=json_default))
        plot_cold(cold, args.out / f"cold{tag}.png")
    wall, phases = serve["wall_s"], serve["phases_s"]
    print_closing(serve["headline"], wall)
    pngs = "" if args.no_plots else f", serve{tag}_ttft_cdf.png" + (f", serve{tag}_ttft_vs_rate.png" if sweep else "")
    log(f"wrote {args.out}/serve{tag}.json{pngs}"
        f"{f', cold{tag}.json, cold{tag}.png' if cold else ''}"
        f" in {wall/60:.1f} min ({', '.join(f'{k} {v:.0f}' for k, v in phases.items())})")


def _model_label(args, model: Path) -> str:
    if args.random_model:
        return describe(parse_spec(args.random_model))
    return str(model.resolve().relative_to(ROOT) if model.resolve().is_relative_to(ROOT) else model)


def print_closing(h: dict, wall: float) -> None:
    best = h["vs_best_baseline"]
    log("\n== closing note")
    log(f"  hypic vs the best baseline, TTFT p50 ({h['shape']}, closed loop): {named(best.get('ttft_p50'))} (seed 3.25x)")
    if "qps_at_slo" in best:
        log(f"  QPS at SLO (p90 TTFT <= {h['slo_s']:.2f} s): hypic {named(best['qps_at_slo'])} (seed 1.66x); "
            f"{', '.join(f'{m} {q:.3f}' for m, q in h['qps_at_slo'].items())} req/s")
    if "cold_speedup_m2" in h:
        log(f"  cold speedup with m = 2 scatter workers (measured): x{h['cold_speedup_m2']:.2f}")
        log(f"  SIMULATED m = {h['sim_m']}: TTFT " + ", ".join(f"{k} x{v:.2f}" for k, v in h["sim_speedup"].items())
            + "; builds " + ", ".join(f"{k} x{v:.2f}" for k, v in h["sim_build_speedup"].items())
            + " (seed: LPT 3.6x vs 2.4x)")
    log(f"  total wall time {wall/60:.1f} min")


if __name__ == "__main__":
    main()