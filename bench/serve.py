"""Serving benchmark: drives the running mesh through the SDK (the way `vllm bench serve` drives a
server) and compares full recompute, prefix cache, additive PIC and hypic side by side on the same
requests.

    python -m bench.serve                        # bundled model, the whole run (<= 15 min)
    python -m bench.serve --model DIR --quick    # a smoke run (any checkpoint; token ids when it
                                                 # has no tokenizer)
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
3. Closed loop (concurrency 1) per shape (RAG, summarization, agent): every mode on the same
   request list -> TTFT p50/p90/p99, inter-token latency, throughput, hit rates per tier.
4. QPS sweep (RAG, Poisson arrivals): rates are multiples of full recompute's service rate on
   this machine (1 / its mean closed-loop TTFT); every mode gets the same requests at each rate
   (fresh ones per rate); a mode's sweep stops at its first rate whose p90 TTFT misses the SLO.
   SLO = --slo-x times full recompute's closed-loop p50 TTFT (RAG) on this machine. QPS at SLO:
   the highest rate whose p90 TTFT <= SLO, measured (highest passing rate) and interpolated
   linearly between the last passing and the first failing rate (rate 0 = the closed-loop p90).
5. Cold path (bench/cold.py): fresh documents on m = 2, then m = 1 scatter workers; simulated
   m = 1, 2, 4, 8 and LPT vs round-robin vs contiguous partitioning on a 32k-token request.

Prefix-cache hit rates are not reported by the combine, so they come from a client-side replay of
its cache (segment-aligned prefixes, LRU of --prefix-cache-bytes with state sizes from the model
config) over the prefix-mode requests in the order they were sent.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import hypic
from bench import cold as C
from bench import workloads as W
from common.engine.modes import LABELS, MODES
from bench.random_model import RANDOM_LABEL
from hypic.launcher import DEFAULT_MODEL, Mesh

CACHED_MODES = tuple(m for m in MODES if m != "full")  # prefix, additive, hypic
SHAPES = ("rag", "summarization", "agent")
ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- payloads ---------------------------------------------------------------------------------

class Encoder:
    """Text segments when the model has a tokenizer (the router tokenizes them), else token ids."""

    def __init__(self, model: Path):
        cfg = json.loads((model / "config.json").read_text())
        self.cfg = cfg.get("text_config", cfg)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.text = (model / "tokenizer.json").exists()

    def seg(self, words: Sequence[str]) -> Any:
        return " ".join(words) if self.text else W.to_ids(words, None, self.vocab_size)

    def state_bytes(self, tokens: int) -> int:
        """ModelState.nbytes of a prompt state (float32): KV of the full-attention layers,
        recurrent + conv state of the linear ones."""
        c = self.cfg
        types = c.get("layer_types") or ["linear_attention"] * int(c["num_hidden_layers"])
        n_full = sum(t == "full_attention" for t in types)
        n_lin = len(types) - n_full
        kv = n_full * 2 * int(c["num_key_value_heads"]) * int(c.get("head_dim", 0) or 0) * 4 * tokens
        nk, nv = int(c.get("linear_num_key_heads", 0)), int(c.get("linear_num_value_heads", 0))
        kd, vd = int(c.get("linear_key_head_dim", 0)), int(c.get("linear_value_head_dim", 0))
        conv = (2 * nk * kd + nv * vd) * (int(c.get("linear_conv_kernel_dim", 4)) - 1)
        return kv + n_lin * 4 * (nv * kd * vd + conv)


class PrefixReplay:
    """Client-side replay of the combine's prefix cache (common/engine/pic/prefix.py): states at segment
    boundaries, keyed by the segments so far, LRU bounded in bytes. Returns the number of
    leading segments each request reuses."""

    def __init__(self, enc: Encoder, max_bytes: int):
        self.enc = enc
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: OrderedDict[tuple, int] = OrderedDict()

    def request(self, shape: str, r: W.Request) -> int:
        keys = [(shape,) + tuple(r.doc_ids[:j + 1]) for j in range(len(r.doc_ids))]
        reused = 0
        for j in range(len(keys) - 1, -1, -1):
            if keys[j] in self.items:
                self.items.move_to_end(keys[j])
                reused = j + 1
                break
        tokens = sum(len(s) for s in r.segments[:reused])
        for j in range(reused, len(keys)):
            tokens += len(r.segments[j])
            if keys[j] in self.items:
                self.items.move_to_end(keys[j])
                continue
            size = self.enc.state_bytes(tokens)
            if size > self.max_bytes:
                continue
            self.items[keys[j]] = size
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, s = self.items.popitem(last=False)
                self.bytes -= s
        return reused


# ---- driving the mesh ---------------------------------------------------------------------------

async def _drive(address: str, reqs: Sequence[W.Request], mode: str, enc: Encoder, *,
                 max_tokens: int, concurrency: int | None, open_loop: bool,
                 timeout: float) -> tuple[list[dict], float]:
    records: list[dict] = [{} for _ in reqs]
    async with hypic.AsyncClient(address, timeout=timeout) as client:
        await client.wait_ready(30)
        t0 = time.perf_counter()

        async def one(k: int, r: W.Request) -> None:
            if open_loop:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            start = time.perf_counter()
            rec: dict[str, Any] = dict(i=r.index, mode=mode, segments=len(r.segments),
                                       prompt_tokens=r.prompt_tokens, sched_s=r.arrival_s,
                                       start_s=start - t0)
            times: list[float] = []
            try:
                stream = client.generate(segments=[enc.seg(s) for s in r.segments],
                                         query=enc.seg(r.query), max_tokens=max_tokens, mode=mode,
                                         timeout=timeout)
                async for _ in stream:
                    times.append(time.perf_counter())
                tm = stream.timings
                rec.update(ttft_s=times[0] - start, e2e_s=times[-1] - start, tokens=len(times),
                           itl_s=[b - a for a, b in zip(times, times[1:])], end_s=times[-1] - t0)
                if tm is not None:
                    rec.update(server_ttft_s=tm.ttft_s, hits=tm.hits, misses=tm.misses,
                               tiers=dict(tm.hits_by_tier), compose_s=tm.compose_s,
                               seams_s=tm.seams_s, query_s=tm.query_prefill_s,
                               lookup_s=tm.lookup_s, transfer_s=tm.transfer_s,
                               scatter_s=tm.scatter_s,
                               builds=[(s.tokens, s.build_s, s.worker) for s in tm.trace
                                       if s.source == "scatter"])
            except Exception as e:  # a failed request is counted, not fatal
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            records[k] = rec

        if open_loop:
            await asyncio.gather(*(one(k, r) for k, r in enumerate(reqs)))
        else:
            it = iter(enumerate(reqs))

            async def worker() -> None:
                for k, r in it:
                    await one(k, r)

            await asyncio.gather(*(worker() for _ in range(max(1, concurrency or 1))))
        wall = time.perf_counter() - t0
    return records, wall


def drive(address: str, reqs: Sequence[W.Request], mode: str, enc: Encoder, *, max_tokens: int,
          concurrency: int | None = 1, open_loop: bool = False,
          timeout: float = 300.0) -> tuple[list[dict], float]:
    """Send `reqs` in `mode`: closed loop at `concurrency`, or open loop at their arrival times.
    Returns per-request records (client-side TTFT and token times, server timings) and the wall
    time."""
    return asyncio.run(_drive(address, reqs, mode, enc, max_tokens=max_tokens,
                              concurrency=concurrency, open_loop=open_loop, timeout=timeout))


# ---- statistics -------------------------------------------------------------------------------

def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else math.nan


def summarize(records: Sequence[dict], wall: float, prefix_reused: Sequence[int] | None = None) -> dict:
    ok = [r for r in records if "error" not in r and "ttft_s" in r]
    ttft = [r["ttft_s"] for r in ok]
    itl = [g for r in ok for g in r["itl_s"]]
    segs = sum(r["segments"] for r in ok)
    out = dict(n=len(records), errors=len(records) - len(ok),
               errors_sample=[r["error"] for r in records if "error" in r][:3],
               ttft_p50_s=pct(ttft, 50), ttft_p90_s=pct(ttft, 90), ttft_p99_s=pct(ttft, 99),
               ttft_mean_s=float(np.mean(ttft)) if ttft else math.nan,
               server_ttft_p50_s=pct([r.get("server_ttft_s", math.nan) for r in ok], 50),
               itl_mean_s=float(np.mean(itl)) if itl else math.nan, itl_p50_s=pct(itl, 50),
               itl_p90_s=pct(itl, 90), e2e_p50_s=pct([r["e2e_s"] for r in ok], 50),
               throughput_rps=len(ok) / wall if wall > 0 else math.nan,
               output_tok_s=sum(r["tokens"] for r in ok) / wall if wall > 0 else math.nan,
               wall_s=wall, segments_mean=segs / len(ok) if ok else math.nan,
               prompt_tokens_mean=float(np.mean([r["prompt_tokens"] for r in ok])) if ok else math.nan)
    if prefix_reused is not None:
        reused = sum(prefix_reused)
        total = sum(r["segments"] for r in records)
        out["hit_rate"] = reused / total if total else math.nan
        out["hits_by_tier"] = {"prefix (replayed)": out["hit_rate"]}
        out["requests_with_hit"] = sum(1 for x in prefix_reused if x) / max(1, len(prefix_reused))
    elif any("hits" in r for r in ok) and any(r.get("hits", 0) + r.get("misses", 0) for r in ok):
        hits = sum(r.get("hits", 0) for r in ok)
        tiers: Counter = Counter()
        for r in ok:
            tiers.update(r.get("tiers", {}))
        out["hit_rate"] = hits / segs if segs else math.nan
        out["hits_by_tier"] = {t: n / segs for t, n in sorted(tiers.items())}
        out["requests_with_hit"] = sum(1 for r in ok if r.get("hits", 0)) / len(ok)
    else:
        out["hit_rate"] = None  # full recompute: no cache
        out["hits_by_tier"] = {}
    for k in ("compose_s", "seams_s", "query_s"):
        vals = [r[k] for r in ok if k in r]
        if vals:
            out[f"{k[:-2]}_p50_s"] = pct(vals, 50)
    return out


def qps_at_slo(points: Sequence[dict], slo_s: float, unloaded_p90_s: float) -> dict:
    """points: [{rate, ttft_p90_s}] in increasing rate, up to and including the first failure."""
    passing = [p for p in points if p["ttft_p90_s"] <= slo_s]
    failing = [p for p in points if p["ttft_p90_s"] > slo_s]
    measured = max((p["rate"] for p in passing), default=0.0)
    lower_bound = not failing
    if failing:
        fb = min(failing, key=lambda p: p["rate"])
        below = [p for p in passing if p["rate"] < fb["rate"]]
        if below:
            a = max(below, key=lambda p: p["rate"])
            ra, ya = a["rate"], a["ttft_p90_s"]
        else:
            ra, ya = 0.0, unloaded_p90_s
        if ya > slo_s:
            interp = 0.0
        else:
            rb, yb = fb["rate"], fb["ttft_p90_s"]
            interp = ra + (slo_s - ya) / (yb - ya) * (rb - ra) if yb > ya else ra
    else:
        interp = measured
    return dict(measured_qps=measured, interpolated_qps=interp, lower_bound=lower_bound)


# ---- the run ----------------------------------------------------------------------------------

def build_workloads(args) -> dict:
    corpus = W.make_corpus(args.corpus, tuple(args.doc_tokens), seed=args.seed * 1000 + 1)
    pool = W.make_corpus(args.summ_pool, tuple(args.summ_tokens), seed=args.seed * 1000 + 2,
                         first_id=100_000)
    s = args.seed * 1000
    mp = args.max_prompt_tokens
    rag_pop = W.Popularity(len(corpus), args.zipf_s, seed=s + 3)
    wl = {
        "corpus": corpus, "pool": pool, "rag_pop": rag_pop,
        "warm": {
            "rag": W.rag_trace(corpus, args.n_warm, seed=s + 10, k=tuple(args.k), zipf_s=args.zipf_s,
                               max_prompt_tokens=mp, popularity=rag_pop),
            "summarization": W.summarization_trace(pool, max(2, args.n_warm // 4), seed=s + 11,
                                                   max_prompt_tokens=mp, popularity_seed=s + 4),
            "agent": W.agent_trace(max(4, args.n_warm // 2), seed=s + 12, pools_seed=s + 5),
        },
        "closed": {
            "rag": W.rag_trace(corpus, args.n_closed, seed=s + 20, k=tuple(args.k), zipf_s=args.zipf_s,
                               max_prompt_tokens=mp, popularity=rag_pop),
            "summarization": W.summarization_trace(pool, args.n_summ, seed=s + 21, max_prompt_tokens=mp,
                                                   popularity_seed=s + 4),
            "agent": W.agent_trace(args.n_agent, seed=s + 22, pools_seed=s + 5),
        },
    }
    for phase in ("warm", "closed"):  # --shapes: only these (RAG alone keeps a slow model's run short)
        wl[phase] = {shape: t for shape, t in wl[phase].items() if shape in args.shapes}
    return wl


def warm_up(mesh: Mesh, enc: Encoder, wl: dict, replay: PrefixReplay, args) -> dict:
    t0 = time.perf_counter()
    rng = random.Random(args.seed + 99)
    tiny = W.Request(0, 0.0, [W.make_document(rng, -1, 24).words, W.make_document(rng, -2, 24).words],
                     ("<q>", "find", W.KEYS[0], "<a>"), [-1, -2])
    for mode in MODES:  # code paths (first calls, channel set-up)
        recs, _ = drive(mesh.router_address, [tiny], mode, enc, max_tokens=2)
        if "error" in recs[0]:
            raise RuntimeError(f"warm-up request failed in mode {mode}: {recs[0]['error']}")
        if mode == "prefix":
            replay.request("tiny", tiny)
    counts = {}
    for shape, trace in wl["warm"].items():
        for mode in CACHED_MODES:
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
    distinct = {shape: len({d for r in tr.requests for d in r.doc_ids}) for shape, tr in wl["warm"].items()}
    return dict(requests=counts, distinct_segments=distinct, wall_s=time.perf_counter() - t0,
                what="one 2-segment request per mode (code paths), then per shape a warm-up trace "
                     "(same corpus/pools and popularity, another seed) in prefix, additive and hypic "
                     "at concurrency 2, max_tokens 1")


def closed_loop(mesh: Mesh, enc: Encoder, wl: dict, replay: PrefixReplay, args) -> dict:
    out = {}
    for shape in wl["closed"]:
        trace = wl["closed"][shape]
        out[shape] = {"trace": trace.summary(), "modes": {}}
        log(f"\n== {shape}: {len(trace)} requests, concurrency {args.concurrency}, "
            f"{trace.summary()['segments_mean']:.1f} segments / "
            f"{trace.summary()['prompt_tokens_mean']:.0f} tokens per prompt on average")
        for mode in MODES:
            reused = [replay.request(shape, r) for r in trace.requests] if mode == "prefix" else None
            recs, wall = drive(mesh.router_address, trace.requests, mode, enc,
                               max_tokens=args.max_tokens, concurrency=args.concurrency)
            s = summarize(recs, wall, reused)
            s["ttft_s"] = sorted(r["ttft_s"] for r in recs if "ttft_s" in r)
            s["records"] = _slim(recs)
            out[shape]["modes"][mode] = s
            log(_row(mode, s))
    return out


def _slim(recs: Sequence[dict]) -> list[dict]:
    keep = ("i", "segments", "prompt_tokens", "sched_s", "start_s", "ttft_s", "server_ttft_s", "e2e_s",
            "hits", "misses", "tiers", "compose_s", "seams_s", "query_s", "error")
    out = []
    for r in recs:
        d = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
        out.append(d)
    return out


def _row(mode: str, s: dict) -> str:
    hr = s.get("hit_rate")
    tiers = ", ".join(f"{t} {v:.0%}" for t, v in s.get("hits_by_tier", {}).items())
    return (f"  {LABELS[mode]:<15} TTFT p50 {s['ttft_p50_s']*1e3:7.0f}  p90 {s['ttft_p90_s']*1e3:7.0f}  "
            f"p99 {s['ttft_p99_s']*1e3:7.0f} ms   ITL {s['itl_mean_s']*1e3:5.1f} ms   "
            f"{s['throughput_rps']:.2f} req/s {s['output_tok_s']:.1f} tok/s   "
            f"hits {'-' if hr is None else f'{hr:.0%}'}{f' ({tiers})' if tiers else ''}"
            + (f"   ERRORS {s['errors']}: {s['errors_sample'][:1]}" if s["errors"] else ""))


def sweep_trace(wl: dict, args, p: int, rate: float) -> W.Trace:
    """The requests of sweep point p: arrivals over about --rate-window seconds (at least
    --n-rate-min, at most --n-rate-max requests), fresh documents draws per point."""
    n = int(min(args.n_rate_max, max(args.n_rate_min, round(rate * args.rate_window))))
    return W.rag_trace(wl["corpus"], n, seed=args.seed * 1000 + 100 + p, rate=rate, k=tuple(args.k),
                       zipf_s=args.zipf_s, max_prompt_tokens=args.max_prompt_tokens,
                       popularity=wl["rag_pop"])


def rate_sweep(mesh: Mesh, enc: Encoder, wl: dict, closed: dict, replay: PrefixReplay, args) -> dict:
    """Per mode, a search over the rate ladder for the bracket [last rate meeting the SLO, first
    rate missing it]: start at the highest rate at or below half the mode's own closed-loop
    service rate, go up while the SLO holds, or down until it holds. Every point reported was
    measured; the same trace is used at a given rate for every mode that runs it."""
    full = closed["rag"]["modes"]["full"]
    mu = 1.0 / full["ttft_mean_s"]
    slo = args.slo_x * full["ttft_p50_s"]
    xs = sorted(args.rates_x)
    rates = [x * mu for x in xs]
    log(f"\n== QPS sweep (RAG, Poisson): full recompute serves {mu:.3f} req/s at concurrency 1; "
        f"SLO p90 TTFT <= {slo:.2f} s ({args.slo_x:g} x full's p50); rate ladder "
        f"{', '.join(f'{r:.3f}' for r in rates)} req/s")
    traces: dict[int, W.Trace] = {}
    out = {"slo_s": slo, "slo_x_full_p50": args.slo_x, "full_service_rate_rps": mu,
           "rates_x": xs, "rates": rates, "window_s": args.rate_window,
           "n_per_rate": [len(sweep_trace(wl, args, p, r)) for p, r in enumerate(rates)], "modes": {}}
    for mode in MODES:
        own = 1.0 / closed["rag"]["modes"][mode]["ttft_mean_s"]
        start = max([p for p, r in enumerate(rates) if r <= 0.5 * own], default=0)
        points: dict[int, dict] = {}

        def run(p: int) -> bool:
            rate = rates[p]
            trace = traces.setdefault(p, sweep_trace(wl, args, p, rate))
            reused = [replay.request("rag", r) for r in trace.requests] if mode == "prefix" else None
            recs, wall = drive(mesh.router_address, trace.requests, mode, enc,
                               max_tokens=args.max_tokens, open_loop=True)
            s = summarize(recs, wall, reused)
            ok = s["ttft_p90_s"] <= slo and not s["errors"]
            points[p] = dict(rate=rate, rate_x=xs[p], n=len(trace), ttft_p50_s=s["ttft_p50_s"],
                             ttft_p90_s=s["ttft_p90_s"] if not s["errors"] else math.inf,
                             ttft_p99_s=s["ttft_p99_s"], itl_mean_s=s["itl_mean_s"],
                             throughput_rps=s["throughput_rps"], hit_rate=s["hit_rate"],
                             hits_by_tier=s["hits_by_tier"], errors=s["errors"],
                             errors_sample=s["errors_sample"], wall_s=wall, meets_slo=ok)
            log(f"  {LABELS[mode]:<15} rate {rate:6.3f} req/s ({len(trace):>2} req)  TTFT p50 "
                f"{s['ttft_p50_s']*1e3:7.0f}  p90 {s['ttft_p90_s']*1e3:7.0f} ms  "
                f"{'meets' if ok else 'MISSES'} SLO  ({wall:.1f} s)"
                + (f"  ERRORS {s['errors']}: {s['errors_sample'][:1]}" if s["errors"] else ""))
            return ok

        if run(start):
            p = start + 1
            while p < len(rates) and run(p):
                p += 1
        else:
            p = start - 1
            while p >= 0 and not run(p):
                p -= 1
        pts = [points[p] for p in sorted(points)]
        q = qps_at_slo(pts, slo, closed["rag"]["modes"][mode]["ttft_p90_s"])
        # the same points at tighter SLOs (valid: a tighter SLO is missed no later)
        q["by_slo_x"] = {f"{x:g}": qps_at_slo(pts, x * full["ttft_p50_s"],
                                              closed["rag"]["modes"][mode]["ttft_p90_s"])["interpolated_qps"]
                         for x in (1.5, 2.0, 2.5, 3.0) if x <= args.slo_x}
        out["modes"][mode] = {"points": pts, "start_rate": rates[start], **q}
        log(f"  {LABELS[mode]:<15} QPS at SLO: {q['interpolated_qps']:.3f} (interpolated), "
            f"{q['measured_qps']:.3f} (highest passing rate){' (lower bound)' if q['lower_bound'] else ''}")
    return out


def cold_path(mesh: Mesh, enc: Encoder, args) -> dict:
    """Fresh documents, m = 2 then m = 1 (scatter1 stopped); the simulation (bench/cold.py)."""
    lengths = W.skewed_lengths(args.cold_tokens, seed=args.seed * 1000 + 7, lo=128,
                               hi=max(256, args.doc_tokens[1]))
    log(f"\n== cold path: {sum(lengths)} tokens in {len(lengths)} segments {lengths}")

    def fresh(rep: int, tag: int) -> W.Request:
        rng = random.Random(10_000_000 + args.seed * 1000 + 10 * rep + tag)
        docs = [W.make_document(rng, 900_000 + i, L) for i, L in enumerate(lengths)]
        q = ("<q>", "find", rng.choice(docs[0].keys), "<a>")
        return W.Request(rep, 0.0, [d.words for d in docs], q,
                         [900_000 + 1000 * (10 * rep + tag) + i for i in range(len(docs))])

    runs: dict[str, list[dict]] = {}
    m2_reqs = [fresh(rep, 2) for rep in range(args.cold_reps)]
    runs["m2"], _ = drive(mesh.router_address, m2_reqs, "hypic", enc, max_tokens=2)
    runs["full"], _ = drive(mesh.router_address, m2_reqs, "full", enc, max_tokens=2)
    mesh.kill("scatter1")
    time.sleep(max(3.0, 3 * 1.0))  # the router polls Scatter.Load every second: scatter1 goes down
    probe = fresh(99, 9)
    probe.segments = probe.segments[:2]
    probe.doc_ids = probe.doc_ids[:2]
    drive(mesh.router_address, [probe], "hypic", enc, max_tokens=1)
    runs["m1"], _ = drive(mesh.router_address, [fresh(rep, 1) for rep in range(args.cold_reps)], "hypic",
                          enc, max_tokens=2)
    for k, recs in runs.items():
        errs = [r["error"] for r in recs if "error" in r]
        if errs:
            raise RuntimeError(f"cold {k}: {errs[0]}")
    workers = {k: sorted({b[2] for r in runs[k] for b in r.get("builds", [])}) for k in ("m1", "m2")}
    hits = {k: sum(r.get("hits", 0) for r in runs[k]) for k in ("m1", "m2")}
    med = {k: C.median([r["ttft_s"] for r in recs]) for k, recs in runs.items()}
    best = {k: min(r["ttft_s"] for r in recs) for k, recs in runs.items()}
    m1 = runs["m1"]
    builds_m1 = [(b[0], b[1]) for r in m1 for b in r["builds"]]
    builds_m2 = [(b[0], b[1]) for r in runs["m2"] for b in r["builds"]]
    cost = C.fit_cost_model(builds_m1)
    per_seg_compose = C.median([(r["compose_s"] + r["seams_s"]) / r["segments"] for r in m1])
    query_s = C.median([r["query_s"] for r in m1])
    compose = lambda L: per_seg_compose  # noqa: E731 (seam recompute + body append: ~constant per segment)
    sim_m1 = C.simulate(lengths, 1, "lpt", cost, compose, query_s).ttft_s
    overhead = med["m1"] - sim_m1
    sim_m2 = C.simulate(lengths, 2, "lpt", cost, compose, query_s, overhead).ttft_s
    measured = dict(prompt_tokens=sum(lengths) + 4, segments=len(lengths), reps=args.cold_reps,
                    m1_ttft_s=med["m1"], m2_ttft_s=med["m2"], full_ttft_s=med["full"],
                    speedup_m2=med["m1"] / med["m2"], m2_vs_full=med["full"] / med["m2"],
                    best_m1_ttft_s=best["m1"], best_m2_ttft_s=best["m2"], best_full_ttft_s=best["full"],
                    speedup_m2_best=best["m1"] / best["m2"],
                    build_sum_m1_s=C.median([sum(b[1] for b in r["builds"]) for r in runs["m1"]]),
                    build_sum_m2_s=C.median([sum(b[1] for b in r["builds"]) for r in runs["m2"]]),
                    m1_ttft_all_s=[r["ttft_s"] for r in runs["m1"]],
                    m2_ttft_all_s=[r["ttft_s"] for r in runs["m2"]],
                    full_ttft_all_s=[r["ttft_s"] for r in runs["full"]],
                    workers_used=workers, hits=hits, sim_m2_lpt_ttft_s=sim_m2)
    log(f"  measured cold TTFT (median of {args.cold_reps}): m=1 {med['m1']:.2f} s, m=2 {med['m2']:.2f} s "
        f"-> x{measured['speedup_m2']:.2f} (best of {args.cold_reps}: x{measured['speedup_m2_best']:.2f}); "
        f"full recompute {med['full']:.2f} s; simulated m=2 {sim_m2:.2f} s; builds per request "
        f"{measured['build_sum_m1_s']:.2f} s (m=1) / {measured['build_sum_m2_s']:.2f} s (m=2, summed over workers)")
    L32 = W.skewed_lengths(args.sim_tokens, seed=args.seed * 1000 + 8, lo=128, hi=4096)
    rows = C.simulate_table(L32, args.sim_m, cost, compose, query_s, overhead)
    a, b, c = cost.coefficients
    simulated = dict(label="SIMULATED from measured per-segment costs (not run on the mesh)",
                     prompt_tokens=sum(L32), lengths=L32, ms=list(args.sim_m), rows=rows,
                     cost_model=dict(a_s=a, b_s_per_token=b, c_s_per_token2=c, observations=builds_m1,
                                     observations_m2=builds_m2),
                     compose_per_segment_s=per_seg_compose, query_s=query_s, overhead_s=overhead)
    for how in C.PARTITIONS:
        cells = "  ".join(f"m={r['m']}: {r['ttft_s']:6.2f} s x{r['speedup_vs_m1']:.2f}"
                          for r in rows if r["partition"] == how)
        log(f"  SIMULATED {sum(L32)}-token request, {how:<11} {cells}")
    return {"label": "cold path: measured m = 1 and 2 on the mesh; larger m SIMULATED",
            "lengths": lengths, "measured": measured, "simulated": simulated}


# ---- plots ------------------------------------------------------------------------------------

COLORS = {"full": "#7f7f7f", "prefix": "#ff7f0e", "additive": "#9467bd", "hypic": "#2ca02c"}


def plot_cdf(closed: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(closed), figsize=(5 * len(closed), 3.8), squeeze=False)
    for ax, (shape, d) in zip(axes[0], closed.items()):
        for mode, s in d["modes"].items():
            xs = s["ttft_s"]
            if xs:
                ax.step([xs[0]] + xs, np.arange(0, len(xs) + 1) / len(xs), where="post",
                        label=LABELS[mode], color=COLORS[mode])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        tr = d["trace"]
        ax.set_title(f"{shape}: {tr['segments_mean']:.1f} segs, {tr['prompt_tokens_mean']:.0f} tok")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, d in sweep["modes"].items():
        pts = d["points"]
        ax.plot([p["rate"] for p in pts], [p["ttft_p90_s"] for p in pts], marker="o", color=COLORS[mode],
                label=f"{LABELS[mode]} p90")
        ax.plot([p["rate"] for p in pts], [p["ttft_p50_s"] for p in pts], marker=".", ls="--",
                color=COLORS[mode], alpha=0.6, label=f"{LABELS[mode]} p50")
    ax.axhline(sweep["slo_s"], color="red", ls=":", label=f"SLO {sweep['slo_s']:.2f} s")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (req/s, Poisson)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("RAG: TTFT vs Poisson rate (each mode searched for its SLO bracket)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- closing note -----------------------------------------------------------------------------

def _ratio(a: float, b: float) -> float | None:
    """a / b; None when b is 0 (0/0 or x/0: no finite ratio)."""
    return a / b if b > 0 else None


def headline(serve: dict, cold: dict | None) -> dict:
    rag = serve["closed"]["rag"]["modes"]
    h = dict(
        ttft_p50_ratio_hypic_vs_prefix=rag["prefix"]["ttft_p50_s"] / rag["hypic"]["ttft_p50_s"],
        ttft_p50_ratio_hypic_vs_full=rag["full"]["ttft_p50_s"] / rag["hypic"]["ttft_p50_s"],
        ttft_p50_ratio_per_shape={shape: serve["closed"][shape]["modes"]["prefix"]["ttft_p50_s"] /
                                  serve["closed"][shape]["modes"]["hypic"]["ttft_p50_s"]
                                  for shape in serve["closed"]},
    )
    sw = serve.get("sweep")
    if sw:
        hq, pq = sw["modes"]["hypic"], sw["modes"]["prefix"]
        h["slo_s"] = sw["slo_s"]
        h["qps_at_slo"] = {m: d["interpolated_qps"] for m, d in sw["modes"].items()}
        h["qps_at_slo_ratio_hypic_vs_prefix"] = _ratio(hq["interpolated_qps"], pq["interpolated_qps"])
        h["qps_at_slo_ratio_measured_rates"] = _ratio(hq["measured_qps"], pq["measured_qps"])
        h["qps_at_slo_ratio_hypic_vs_full"] = _ratio(hq["interpolated_qps"], sw["modes"]["full"]["interpolated_qps"])
        h["qps_hypic_lower_bound"] = hq["lower_bound"]
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
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                    help="workload shapes of the warm-up and closed loop (the sweep is RAG's)")
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
    ap.add_argument("--cold-tokens", type=int, default=8192)
    ap.add_argument("--cold-reps", type=int, default=5)
    ap.add_argument("--sim-tokens", type=int, default=32768)
    ap.add_argument("--sim-m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=None, help="mesh data dir (default: a fresh temp dir)")
    ap.add_argument("--tag", default="", help="suffix of the output files (serve<tag>.json ...)")
    # a running deployment instead of a mesh of our own (bench/remote.py)
    ap.add_argument("--base-url", default="", help="benchmark this OpenAI-compatible front "
                    "(http://host:port) instead of starting a mesh")
    ap.add_argument("--address", default="", help="benchmark this router (host:port) over gRPC")
    ap.add_argument("--trace", type=Path, default=None, help="replay these requests (JSONL: "
                    "segments, query, max_tokens, arrival_s) against --base-url / --address")
    ap.add_argument("--mode", default="hypic", help="prefill mode of the --base-url/--address run")
    ap.add_argument("--api-key", default="unused", help="the front's API key (--base-url)")
    ap.add_argument("--served-model", default="", help="model id at --base-url (default: the first)")
    args = ap.parse_args(argv)
    if "rag" not in args.shapes:
        ap.error("--shapes must include rag (the sweep and the headline are RAG's)")
    if args.quick:
        args.corpus, args.doc_tokens, args.summ_pool, args.summ_tokens = 24, [16, 128], 6, [64, 192]
        args.max_prompt_tokens, args.n_warm, args.n_closed, args.n_summ, args.n_agent = 512, 4, 4, 2, 4
        args.n_rate_min, args.n_rate_max, args.rate_window = 4, 8, 2.0
        args.rates_x, args.cold_tokens, args.cold_reps = [0.5, 1.0, 2.0], 600, 1
        args.max_tokens, args.host_bytes = 4, "1MiB"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.base_url or args.address:
        from bench import remote

        return remote.main(args, argv if argv is not None else sys.argv[1:])
    t_start = time.perf_counter()
    random_dir = None
    if args.random_model:
        from bench.random_model import describe, parse_spec, save_random_model

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
    tmp = None
    data_dir = args.data_dir
    if data_dir is None:
        tmp = tempfile.mkdtemp(prefix="hypic-bench-serve-")
        data_dir = Path(tmp)
    phases: dict[str, float] = {}
    replay = PrefixReplay(enc, args.prefix_cache_bytes)
    serve: dict[str, Any] = {}
    cold = None
    try:
        t = time.perf_counter()
        with Mesh(model, data_dir, n_scatter=args.n_scatter, threads=1, start_timeout_s=300,
                  n_segcache=args.segcaches, remote_tier=args.remote_tier,
                  extra_args={"segcache": ["--host-bytes", str(args.host_bytes)],
                              "router": ["--max-prompt-tokens", str(max(32768, args.sim_tokens))]}) as mesh:
            phases["mesh_start_s"] = time.perf_counter() - t
            log(f"mesh up in {phases['mesh_start_s']:.1f} s: {mesh.addresses}")
            t = time.perf_counter()
            warm = warm_up(mesh, enc, wl, replay, args)
            phases["warm_up_s"] = time.perf_counter() - t
            t = time.perf_counter()
            closed = closed_loop(mesh, enc, wl, replay, args)
            phases["closed_loop_s"] = time.perf_counter() - t
            sweep = None
            if not args.no_sweep:
                t = time.perf_counter()
                sweep = rate_sweep(mesh, enc, wl, closed, replay, args)
                phases["sweep_s"] = time.perf_counter() - t
            if not args.no_cold and args.n_scatter >= 2:
                t = time.perf_counter()
                cold = cold_path(mesh, enc, args)
                phases["cold_s"] = time.perf_counter() - t
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t_start
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
        warm_up=warm, closed=closed, sweep=sweep, phases_s=phases, wall_s=wall,
        prefix_replay=dict(max_bytes=args.prefix_cache_bytes, bytes_at_end=replay.bytes,
                           entries_at_end=len(replay.items)),
    )
    serve["headline"] = headline(serve, cold)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag
    (args.out / f"serve{tag}.json").write_text(json.dumps(serve, indent=1, default=_json_default))
    plot_cdf(closed, args.out / f"serve{tag}_ttft_cdf.png")
    if sweep:
        plot_rate(sweep, args.out / f"serve{tag}_ttft_vs_rate.png")
    if cold:
        cold["command"] = serve["command"]
        cold["model"] = serve["model"]
        (args.out / f"cold{tag}.json").write_text(json.dumps(cold, indent=1, default=_json_default))
        C.plot(cold, args.out / f"cold{tag}.png")
    print_closing(serve["headline"], wall)
    log(f"wrote {args.out}/serve{tag}.json, serve{tag}_ttft_cdf.png"
        f"{f', serve{tag}_ttft_vs_rate.png' if sweep else ''}{f', cold{tag}.json, cold{tag}.png' if cold else ''}"
        f" in {wall/60:.1f} min ({', '.join(f'{k} {v:.0f}' for k, v in phases.items())})")
    return serve


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def _model_label(args, model: Path) -> str:
    if args.random_model:
        from bench.random_model import describe, parse_spec

        return describe(parse_spec(args.random_model))
    return str(model.resolve().relative_to(ROOT) if model.resolve().is_relative_to(ROOT) else model)


def print_closing(h: dict, wall: float) -> None:
    log("\n== closing note")
    log(f"  hypic vs prefix cache, TTFT p50 (RAG, closed loop): x{h['ttft_p50_ratio_hypic_vs_prefix']:.2f} "
        f"(seed 3.25x); vs full recompute x{h['ttft_p50_ratio_hypic_vs_full']:.2f}")
    if "qps_at_slo_ratio_hypic_vs_prefix" in h:
        r = h["qps_at_slo_ratio_hypic_vs_prefix"]
        log(f"  QPS at SLO (p90 TTFT <= {h['slo_s']:.2f} s): hypic / prefix {'n/a' if r is None else f'x{r:.2f}'} "
            f"(seed 1.66x); {', '.join(f'{m} {q:.3f}' for m, q in h['qps_at_slo'].items())} req/s")
    if "cold_speedup_m2" in h:
        log(f"  cold speedup with m = 2 scatter workers (measured): x{h['cold_speedup_m2']:.2f}")
        log(f"  SIMULATED m = {h['sim_m']}: TTFT " + ", ".join(f"{k} x{v:.2f}" for k, v in h["sim_speedup"].items())
            + "; builds " + ", ".join(f"{k} x{v:.2f}" for k, v in h["sim_build_speedup"].items())
            + " (seed: LPT 3.6x vs 2.4x)")
    log(f"  total wall time {wall/60:.1f} min")


if __name__ == "__main__":
    main()
