"""TTFT on the RAG trace when the corpus outgrows one segcache's host tier: one instance (its
LMDB serves the tail) vs several instances (their host tiers add up) vs one instance with the
shared Mooncake tier, side by side in one run.

    python -m bench.serve_cache [--corpus 48] [--instances 4] [--out bench/results]

Each configuration gets a fresh mesh (hypic.launcher.Mesh: segcache instance(s), scatter(s), a
combine, the router; torch threads=1 per process) on the bundled model, and the same requests:

1. Sizing: an entry's bytes are affine in its tokens; two entries built in-process fix the line,
   and the corpus's entry bytes follow from its documents' token counts (the bundled tokenizer
   maps one word to one token). One instance's host tier is corpus_bytes / --ratio (4).
2. Warm-up: every document once (as many per request as the prompt budget holds), then a
   warm-up RAG trace (another seed, same popularity) at concurrency 2, so that the tiers hold
   what a long-running server's would. With the shared tier, the run waits until every entry was written behind to the store.
3. Measured: a closed-loop RAG trace (hypic mode, concurrency 1): client-side TTFT p50/p90 and the
   segment hits by tier the router reports.

Configurations (--configs picks some):
  lmdb      1 instance, host tier H, LMDB (default budget) holds the tail
  sharded   --instances instances, host tier H each (together >= the corpus)
  mooncake  1 instance, host tier H and LMDB budget H (a box whose local disk is as small as its
            DRAM, e.g. a pod without a volume) + a Mooncake master holding every entry: the tail
            comes from the shared tier (a Get reads, verifies and promotes it)
  rebuild   1 instance, host tier H and LMDB budget H, no shared tier: the tail is rebuilt (the
            reference the other three are for)
Writes bench/results/serve_cache.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import workloads as W  # noqa: E402
from bench.driver import Encoder, drive, log, pct  # noqa: E402
from common.engine.hybrid_engine import HybridEngine  # noqa: E402
from hypic.launcher import DEFAULT_MODEL, Mesh  # noqa: E402

MiB = 1 << 20
CONFIGS = ("lmdb", "sharded", "mooncake", "rebuild")
SEAM = 8


def entry_line(model: Path) -> tuple[float, float]:
    """(bytes at 0 tokens, bytes per token) of a serialized entry, from two real entries."""
    engine = HybridEngine.from_pretrained(model)
    sizes = {n: len(engine.build_entry([1 + i % 300 for i in range(n)], seam=SEAM).to_bytes())
             for n in (64, 512)}
    per_token = (sizes[512] - sizes[64]) / (512 - 64)
    return sizes[64] - 64 * per_token, per_token


def segcache_metric(mesh: Mesh, name: str, label: str = "") -> float:
    """Sum of one metric over the mesh's segcache instances (their Prometheus endpoints)."""
    total = 0.0
    for svc_name, svc in mesh.services.items():
        if not svc_name.startswith("segcache"):
            continue
        url = f"http://127.0.0.1:{svc.info['metrics_port']}/metrics"
        for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
            if line.startswith(name) and label in line:
                total += float(line.split()[-1])
    return total


def mesh_for(config: str, model: Path, data_dir: Path, host: int, corpus_bytes: int,
             biggest: int, args) -> Mesh:
    seg = ["--host-bytes", str(host), "--metrics-port", "0"]
    kw: dict[str, Any] = {}
    if config == "sharded":
        kw["n_segcache"] = args.instances
    if config in ("mooncake", "rebuild"):
        seg += ["--disk-bytes", str(host)]
    if config == "mooncake":
        kw["remote_tier"] = True
        seg += ["--remote-segment-bytes", str(2 * corpus_bytes + 64 * MiB),
                "--remote-buffer-bytes", str(biggest + 8 * MiB),
                "--remote-queue-entries", str(4 * args.corpus)]
    return Mesh(model, data_dir, n_scatter=args.n_scatter, threads=1, seam=SEAM,
                start_timeout_s=300, extra_args={"segcache": seg, "router": [
                    "--max-prompt-tokens", str(args.max_prompt_tokens + 64)]}, **kw)


def run_config(config: str, model: Path, enc: Encoder, corpus: list, traces: dict, host: int,
               corpus_bytes: int, biggest: int, args) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix=f"hypic-serve-cache-{config}-"))
    try:
        t0 = time.perf_counter()
        with mesh_for(config, model, data_dir, host, corpus_bytes, biggest, args) as mesh:
            start_s = time.perf_counter() - t0
            log(f"[{config}] mesh up in {start_s:.0f} s: {', '.join(mesh.names)}")
            t = time.perf_counter()
            for name in ("every_doc", "warm"):
                recs, wall = drive(mesh.router_address, traces[name].requests, "hypic", enc,
                                   max_tokens=1, concurrency=2)
                errs = [r["error"] for r in recs if "error" in r]
                log(f"[{config}] warm-up {name}: {len(recs)} requests in {wall:.0f} s"
                    + (f", {len(errs)} errors, e.g. {errs[0]}" if errs else ""))
            if config == "mooncake":  # measure with the store holding what was built
                end = time.monotonic() + 120
                while segcache_metric(mesh, "hypic_segcache_remote_ops", 'outcome="written"') < len(corpus):
                    if time.monotonic() > end:
                        log(f"[{config}] not every entry reached the store in 120 s")
                        break
                    time.sleep(0.5)
            warm_s = time.perf_counter() - t
            recs, wall = drive(mesh.router_address, traces["measure"].requests, "hypic", enc,
                               max_tokens=args.max_tokens, concurrency=1)
            tiers: Counter = Counter()
            for r in recs:
                tiers.update(r.get("tiers", {}))
            ok = [r for r in recs if "ttft_s" in r]
            segments = sum(r["segments"] for r in ok)
            misses = sum(r.get("misses", 0) for r in ok)
            held = {tier: segcache_metric(mesh, "segcache_bytes", f'tier="{tier}"')
                    for tier in ("host", "disk")}
            remote = ({o: segcache_metric(mesh, "hypic_segcache_remote_ops", f'outcome="{o}"')
                       for o in ("written", "dropped", "error", "hit", "miss", "rejected")}
                      if config == "mooncake" else None)
        return dict(config=config, segcache_instances=args.instances if config == "sharded" else 1,
                    host_bytes_per_instance=host, mesh_start_s=start_s, warm_s=warm_s,
                    measured_wall_s=wall, n=len(recs), errors=len(recs) - len(ok),
                    ttft_p50_s=pct([r["ttft_s"] for r in ok], 50),
                    ttft_p90_s=pct([r["ttft_s"] for r in ok], 90),
                    server_ttft_p50_s=pct([r.get("server_ttft_s", float("nan")) for r in ok], 50),
                    segments=segments, built=misses,
                    hits_by_tier={t: n for t, n in sorted(tiers.items())},
                    held_bytes_at_end=held, remote_ops=remote,
                    prompt_tokens_mean=sum(r["prompt_tokens"] for r in ok) / max(len(ok), 1))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def every_document(corpus: list, max_prompt_tokens: int) -> list:
    """Requests that name every document once, as many per request as the prompt budget holds."""
    groups: list[list] = [[]]
    for d in corpus:
        if groups[-1] and sum(x.n_tokens for x in groups[-1]) + d.n_tokens + 4 > max_prompt_tokens:
            groups.append([])
        groups[-1].append(d)
    return [W.Request(i, 0.0, [d.words for d in g], ("<q>", "find", g[0].keys[0], "<a>"),
                      [d.id for d in g]) for i, g in enumerate(groups)]


def table(rows: list[dict]) -> str:
    head = (f"{'config':<10} {'inst':>4} {'TTFT p50':>9} {'p90':>8} {'segs':>5} {'built':>6} "
            f"{'host':>5} {'disk':>5} {'remote':>6}  hits by tier")
    lines = [head]
    for r in rows:
        t = r["hits_by_tier"]
        lines.append(f"{r['config']:<10} {r['segcache_instances']:>4} "
                     f"{r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p90_s'] * 1e3:>6.0f}ms "
                     f"{r['segments']:>5} {r['built']:>6} {t.get('host', 0):>5} "
                     f"{t.get('disk', 0):>5} {t.get('remote', 0):>6}  {t}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--instances", type=int, default=4, help="segcache instances of 'sharded'")
    ap.add_argument("--ratio", type=float, default=4.0,
                    help="corpus entry bytes / one instance's host tier")
    ap.add_argument("--corpus", type=int, default=48, help="RAG corpus size (documents)")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--k", type=int, nargs=2, default=[2, 6])
    ap.add_argument("--zipf-s", type=float, default=0.8)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--n-warm", type=int, default=24)
    ap.add_argument("--n-measure", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--n-scatter", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs):
        sys.exit(f"--configs: choose from {', '.join(CONFIGS)}")
    t_start = time.perf_counter()
    model = Path(args.model)
    enc = Encoder(model)
    corpus = W.make_corpus(args.corpus, tuple(args.doc_tokens), seed=args.seed * 1000 + 1)
    pop = W.Popularity(len(corpus), args.zipf_s, seed=args.seed * 1000 + 3)
    traces = {"every_doc": W.Trace("rag", every_document(corpus, args.max_prompt_tokens)),
              "warm": W.rag_trace(corpus, args.n_warm, seed=args.seed * 1000 + 10, k=tuple(args.k),
                                  zipf_s=args.zipf_s, max_prompt_tokens=args.max_prompt_tokens,
                                  popularity=pop),
              "measure": W.rag_trace(corpus, args.n_measure, seed=args.seed * 1000 + 20,
                                     k=tuple(args.k), zipf_s=args.zipf_s,
                                     max_prompt_tokens=args.max_prompt_tokens, popularity=pop)}
    base, per_token = entry_line(model)
    sizes = [int(base + per_token * d.n_tokens) for d in corpus]
    corpus_bytes = sum(sizes)
    host = int(corpus_bytes / args.ratio)
    log(f"corpus {len(corpus)} docs, {sum(d.n_tokens for d in corpus)} tokens, entries "
        f"{corpus_bytes / MiB:.1f} MiB ({base / 1024:.0f} KiB + {per_token:.0f} B/token); host tier "
        f"{host / MiB:.1f} MiB per instance (1/{args.ratio:g} of the corpus)")
    load0 = os.getloadavg()
    rows = [run_config(c, model, enc, corpus, traces, host, corpus_bytes, max(sizes), args)
            for c in configs]
    wall = time.perf_counter() - t_start
    print()
    print(f"RAG trace, {args.n_measure} measured requests (closed loop, hypic); corpus "
          f"{corpus_bytes / MiB:.1f} MiB of entries = {args.ratio:g} x one host tier "
          f"({host / MiB:.1f} MiB); hits by tier in segments")
    print(table(rows))
    result = dict(bench="serve_cache", command="python -m bench.serve_cache " + " ".join(
        argv if argv is not None else sys.argv[1:]), model=str(model),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_start=load0,
                     loadavg_end=os.getloadavg(), torch_threads_per_process=1),
        params={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        corpus=dict(docs=len(corpus), tokens=sum(d.n_tokens for d in corpus), entry_bytes=corpus_bytes,
                    entry_bytes_line=[base, per_token]),
        traces={k: v.summary() for k, v in traces.items()}, host_bytes_per_instance=host,
        rows=rows, wall_s=wall, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_cache.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}/serve_cache.json in {wall / 60:.1f} min")
    return result


if __name__ == "__main__":
    main()
