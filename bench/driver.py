"""The shared driver of the benchmarks: how a request is encoded for a model (`Encoder`), the
client-side replay of the combine's prefix cache, driving a mesh through the SDK (`drive`), the
summaries and percentiles of its records, the serving workloads built from the command line, the
log line, the JSON encoder of results, and the timing helpers every micro-benchmark uses.

Benchmark modules import this one; it imports no benchmark module.
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import hypic
from bench import trace as TR
from bench import workloads as W

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, flush=True)


def json_default(o):
    """json.dumps(default=...) of results: numpy scalars as numbers, paths as strings."""
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


# ---- timing ---------------------------------------------------------------------------------------

# cpu: the process's CPU time, robust when other jobs share the cores (use with one torch thread)
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def add_clock_arg(ap) -> None:
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: process CPU time (robust when other jobs share the cores; use with 1 thread)")


def median(xs: Sequence[float]) -> float:
    """The median; NaN for no values."""
    return statistics.median(xs) if len(xs) else math.nan


def timed(fn: Callable, *args, clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """(seconds, result) of one call fn(*args)."""
    t0 = clock()
    out = fn(*args)
    return clock() - t0, out


def best(fn: Callable, repeats: int, warm_up: bool = False,
         clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """(fastest of `repeats` calls, the last call's result); one untimed call first if `warm_up`."""
    if warm_up:
        fn()
    fastest, out = math.inf, None
    for _ in range(repeats):
        secs, out = timed(fn, clock=clock)
        fastest = min(fastest, secs)
    return fastest, out


def best_of(fns: dict[str, Callable], reps: int, ratios: Sequence[tuple[str, str]] = (),
            clock: Callable[[], float] = time.process_time) -> dict[str, float]:
    """Best time of each callable over `reps` interleaved rounds (after one untimed call each),
    plus, for every (a, b) in `ratios`, the median over rounds of the paired ratio t_a / t_b
    (robust to slow drifts of the machine's load)."""
    for f in fns.values():
        f()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            runs[name].append(timed(f, clock=clock)[0])
    out = {name: min(ts) for name, ts in runs.items()}
    for x, y in ratios:
        out[f"{x}/{y}"] = statistics.median(tx / ty for tx, ty in zip(runs[x], runs[y]))
    return out


# ---- payloads ---------------------------------------------------------------------------------

class Encoder:
    """Text segments when the model has a tokenizer (the router tokenizes them), else token ids."""

    def __init__(self, model: Path):
        cfg = json.loads((model / "config.json").read_text())
        self.cfg = cfg.get("text_config", cfg)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.text = (model / "tokenizer.json").exists()

    def seg(self, words: Sequence) -> Any:
        if words and isinstance(words[0], int):  # token ids already (a replayed trace's)
            return list(words)
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

async def send_all(one: Callable[[int, Any], Any], reqs: Sequence[Any], open_loop: bool,
                   concurrency: int | None) -> None:
    """Await one(k, request) for every request: all at once (open loop: `one` waits for the
    request's arrival time), or by `concurrency` workers taking the next request in turn."""
    if open_loop:
        await asyncio.gather(*(one(k, r) for k, r in enumerate(reqs)))
        return
    it = iter(enumerate(reqs))

    async def worker() -> None:
        for k, r in it:
            await one(k, r)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency or 1))))


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
                                         query=enc.seg(r.query), max_tokens=r.max_tokens or max_tokens, mode=mode,
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

        await send_all(one, reqs, open_loop, concurrency)
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

def slim_records(recs: Sequence[dict]) -> list[dict]:
    """The per-request fields a results JSON keeps (client and server timings, hits), rounded."""
    keep = ("i", "segments", "prompt_tokens", "sched_s", "start_s", "end_s", "ttft_s", "server_ttft_s", "e2e_s",
            "hits", "misses", "tiers", "compose_s", "seams_s", "query_s", "error")
    return [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if k in keep} for r in recs]


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
        # of the cache entries the router looked up: a long segment cut into pieces
        # (common/engine/cut.py) counts as its pieces, so the client's segment count is not the base
        looked_up = sum(r.get("hits", 0) + r.get("misses", 0) for r in ok)
        tiers: Counter = Counter()
        for r in ok:
            tiers.update(r.get("tiers", {}))
        out["hit_rate"] = hits / looked_up
        out["hits_by_tier"] = {t: n / looked_up for t, n in sorted(tiers.items())}
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


# ---- the serving workloads (bench.serve and bench.remote) ----------------------------------



def shape_trace(wl: dict, args, shape: str, n: int, seed: int, rate: float | None = None) -> W.Trace:
    """n requests of `shape` over the run's corpus and pools (the same popularity in every
    phase, so the warm-up's popular segments are the closed loop's and the sweep's); `seed`
    draws the requests, `rate` their Poisson arrivals. "trace" (bench/serve.py --trace) replays
    the user's trace, its arrivals scaled to `rate` (bench.trace.at_rate)."""
    s, mp = args.seed * 1000, args.max_prompt_tokens
    if shape == "rag":
        return W.rag_trace(wl["corpus"], n, seed=seed, rate=rate, k=tuple(args.k), zipf_s=args.zipf_s,
                           max_prompt_tokens=mp, popularity=wl["rag_pop"])
    if shape == "summarization":
        return W.summarization_trace(wl["pool"], n, seed=seed, rate=rate, max_prompt_tokens=mp,
                                     popularity_seed=s + 4)
    if shape == "agent":
        return W.agent_trace(n, seed=seed, rate=rate, pools_seed=s + 5)
    if shape == "chat":
        return W.chat_trace(n, seed=seed, rate=rate, pools_seed=s + 6)
    if shape == "fewshot":
        return W.fewshot_trace(n, seed=seed, rate=rate, pools_seed=s + 7)
    if shape == "trace":
        return TR.at_rate(wl["user_trace"], rate, seed) if rate else wl["user_trace"]
    raise ValueError(f"unknown workload shape {shape!r}")


def build_workloads(args) -> dict:
    """The corpus, pools and popularity of a serving run, and per shape in --shapes a warm-up
    trace and a closed-loop trace (other seeds, the same popular segments)."""
    corpus = W.make_corpus(args.corpus, tuple(args.doc_tokens), seed=args.seed * 1000 + 1)
    pool = W.make_corpus(args.summ_pool, tuple(args.summ_tokens), seed=args.seed * 1000 + 2,
                         first_id=100_000)
    s = args.seed * 1000
    wl: dict[str, Any] = {"corpus": corpus, "pool": pool,
                          "rag_pop": W.Popularity(len(corpus), args.zipf_s, seed=s + 3)}
    if getattr(args, "trace", None):
        wl["user_trace"] = TR.to_trace(TR.read(args.trace, args.max_tokens))
        wl["warm"], wl["closed"] = {}, {"trace": wl["user_trace"]}  # the trace warms its own caches
        return wl
    n_closed = dict(rag=args.n_closed, summarization=args.n_summ, agent=args.n_agent,
                    chat=getattr(args, "n_chat", 12), fewshot=getattr(args, "n_fewshot", 12))
    n_warm = dict(rag=args.n_warm, summarization=max(2, args.n_warm // 4), agent=max(4, args.n_warm // 2),
                  chat=max(4, args.n_warm // 2), fewshot=args.n_warm)
    shapes = [x for x in W.SHAPES if x in args.shapes]  # --shapes: only these (RAG alone keeps a slow model's run short)
    wl["warm"] = {x: shape_trace(wl, args, x, n_warm[x], seed=s + 10 + i) for i, x in enumerate(W.SHAPES)
                  if x in shapes}
    wl["closed"] = {x: shape_trace(wl, args, x, n_closed[x], seed=s + 20 + i) for i, x in enumerate(W.SHAPES)
                    if x in shapes}
    return wl
