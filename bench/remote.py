"""`python -m bench.serve --base-url URL | --address HOST:PORT`: benchmark a running deployment
instead of starting a mesh, through the OpenAI-compatible front (streaming completions with the
`hypic` extension carrying the segments) or through gRPC (the SDK).

Requests: the closed-loop requests of bench/serve.py's --workload (RAG by default; same --seed /
--corpus / --k ...), or
`--trace FILE.jsonl`, the user's own requests in bench/trace.py's format (Mooncake's fields plus
the segments; the older lines `{"segments": [...], "query": ..., "max_tokens": 8, "arrival_s":
0.25}` read the same). With arrival times the trace is replayed open loop at those offsets,
else closed loop at --concurrency; each request's output_length is its max_tokens. Prints TTFT /
ITL / throughput / cached tokens and writes serve_remote<tag>.json under --out.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import hypic
from bench import trace
from bench.driver import build_workloads, log, send_all, summarize

SegmentLike = Union[str, list[int]]


@dataclass
class TraceRequest:
    index: int
    segments: list[SegmentLike]
    query: SegmentLike
    max_tokens: int
    arrival_s: float = 0.0


def load_trace(path: Path, default_max_tokens: int) -> list[TraceRequest]:
    """The requests of a JSONL trace (bench/trace.py's format; ValueError naming the line when
    one is malformed)."""
    return [TraceRequest(ln.index, ln.segments, ln.query, ln.max_tokens, ln.arrival_s)
            for ln in trace.read(path, default_max_tokens)]


def workload_requests(args: Any) -> list[TraceRequest]:
    """bench/serve.py's closed-loop requests of --workload (RAG by default), as text."""
    wl = build_workloads(args)
    return [TraceRequest(i, [" ".join(s) for s in r.segments], " ".join(r.query), args.max_tokens)
            for i, r in enumerate(wl["closed"][args.workload].requests)]


# ---- one request each way ---------------------------------------------------------------------------

async def _http_one(client: Any, model: str, r: TraceRequest, mode: str) -> tuple[list[float], dict]:
    stream = await client.completions.create(
        model=model, prompt=r.query, max_tokens=r.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"hypic": {"segments": r.segments, "mode": mode}})
    times, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    info = {}
    if usage is not None:
        info = dict(prompt_tokens=usage.prompt_tokens, tokens=usage.completion_tokens,
                    cached_tokens=usage.prompt_tokens_details.cached_tokens
                    if usage.prompt_tokens_details else 0)
    return times, info


async def _grpc_one(client: Any, model: str, r: TraceRequest, mode: str) -> tuple[list[float], dict]:
    stream = client.generate(segments=r.segments, query=r.query, max_tokens=r.max_tokens, mode=mode)
    times = []
    async for _ in stream:
        times.append(time.perf_counter())
    t = stream.timings
    info = {}
    if t is not None:
        info = dict(prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                    server_ttft_s=t.ttft_s, hits=t.hits, misses=t.misses,
                    tiers=dict(t.hits_by_tier))
    return times, info


async def drive(reqs: Sequence[TraceRequest], *, base_url: str = "", address: str = "",
                model: str = "", api_key: str = "unused", mode: str = "hypic",
                concurrency: int = 1, timeout: float = 300.0) -> tuple[list[dict], float]:
    """Send every request (open loop when any has an arrival time, else closed loop at
    `concurrency`); per-request records in bench/serve.py's shape, and the wall time."""
    if base_url:
        import openai  # lazily: a test-only extra (pyproject's [test]); only this OpenAI-front run needs it

        client: Any = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key,
                                         timeout=timeout, max_retries=0)
        if not model:
            model = (await client.models.list()).data[0].id
        one = _http_one
    else:
        client = hypic.AsyncClient(address, timeout=timeout)
        await client.wait_ready(30)
        one = _grpc_one
    open_loop = any(r.arrival_s > 0 for r in reqs)
    records: list[dict] = [{} for _ in reqs]
    t0 = time.perf_counter()

    async def run(k: int, r: TraceRequest) -> None:
        if open_loop:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        start = time.perf_counter()
        rec: dict[str, Any] = dict(i=r.index, mode=mode, segments=len(r.segments),
                                   sched_s=r.arrival_s, start_s=start - t0, prompt_tokens=0)
        try:
            times, info = await one(client, model, r, mode)
            rec.update(tokens=len(times))
            rec.update(info)
            if times:
                rec.update(ttft_s=times[0] - start, e2e_s=times[-1] - start,
                           itl_s=[b - a for a, b in zip(times, times[1:])], end_s=times[-1] - t0)
            else:
                rec["error"] = "no tokens"
        except Exception as e:  # a failed request is counted, not fatal
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        records[k] = rec

    try:
        await send_all(run, reqs, open_loop, concurrency)
    finally:
        await client.close()
    return records, time.perf_counter() - t0


def main(args: Any, argv: Sequence[str] | None) -> dict:
    """The --base-url / --address run of bench/serve.py."""
    reqs = load_trace(args.trace, args.max_tokens) if args.trace else workload_requests(args)
    target = args.base_url or args.address
    log(f"{len(reqs)} requests ({'trace ' + str(args.trace) if args.trace else args.workload + ' workload'}) "
        f"to {target} ({'OpenAI front' if args.base_url else 'gRPC'}), mode {args.mode}")
    records, wall = asyncio.run(drive(reqs, base_url=args.base_url, address=args.address,
                                      model=args.served_model, api_key=args.api_key,
                                      mode=args.mode, concurrency=args.concurrency))
    s = summarize(records, wall)
    ok = [r for r in records if "error" not in r]
    s["cached_tokens_mean"] = sum(r.get("cached_tokens", 0) for r in ok) / max(1, len(ok))
    log(f"  TTFT p50 {s['ttft_p50_s']*1e3:.0f} ms  p90 {s['ttft_p90_s']*1e3:.0f} ms  "
        f"ITL {s['itl_mean_s']*1e3:.1f} ms  {s['throughput_rps']:.2f} req/s  "
        f"{s['output_tok_s']:.1f} tok/s  cached tokens/request {s['cached_tokens_mean']:.0f}"
        + (f"  ERRORS {s['errors']}: {s['errors_sample'][:1]}" if s["errors"] else ""))
    out = dict(command="python -m bench.serve " + " ".join(argv or []), target=target,
               via="openai" if args.base_url else "grpc", mode=args.mode,
               trace=str(args.trace) if args.trace else None, summary=s, records=records)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_remote{args.tag}.json"
    path.write_text(json.dumps(out, indent=1, default=float))
    log(f"wrote {path}")
    return out
