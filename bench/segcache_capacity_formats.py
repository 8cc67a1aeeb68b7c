"""Entry formats at equal cache budgets: what compact T and S buy on the RAG trace (issue 28 item 4).

    python -m bench.segcache_capacity_formats [--requests 3000] [--out bench/results]

The RAG trace of bench/segcache_capacity.py is replayed against one cache of a fixed byte budget
(a fraction of the corpus's bytes in fp32 entries: the same bytes for every format), evicting with
segcache's GDSF (SimTier); a miss is rebuilt. Each document's entry is stored in fp32, bf16, fp8t or
fp8 (common/engine/pic/compact.py). An entry's bytes are affine in its tokens: a constant linear part
(T, S, conv tail: what the format shrinks) plus keys and values per attention-layer token (which
the fp8 format shrinks too).

Two entry models:
  bundled   the bundled model's real entries (models/hypic-tiny-qwen35, or --model): built here at
            two lengths in fp32 and written in each format (SegmentEntry.to_bytes), so their bytes
            are measured, as are the build time per token (the rebuild a miss costs) and the parse
            time per byte of each format (SegmentEntry.from_bytes: checksum and widening to fp32);
  Qwen3-Next-80B-A3B  the bytes bench.entry_bytes computes from its published config (bf16 KV):
            the family where T and S dominate an entry. No build or parse time (not run here).

Per budget and format: segment hit rate (per lookup) and token hit rate after the warm-up; the
entry bytes a request moves on its hits; the transfer time per request, those bytes at the gRPC
and NIXL read rates measured by bench/segcache.py (bench/results/segcache.json, or
--transfer-gbps) plus, for the bundled model, the measured parse time; the rebuild time per request
(missed tokens x build time per token); and TTFT estimated as rebuild + transfer over one stream
and one builder, serially (an upper bound: the combine fetches and scatter workers build a
request's segments concurrently). These TTFT figures are a model fed with measured rates, not an
end-to-end measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from bench import workloads as W
from bench.segcache_capacity import REPO, SimTier, add_args, rag
from common.engine.dtypes import ENTRY_FORMATS
from hypic.launcher import DEFAULT_MODEL

FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)  # cache budget / the corpus's fp32 entry bytes
ARCH = "Qwen3-Next-80B-A3B"
SEAM = 8
LENGTHS = (256, 1024)  # tokens of the bundled model's measured entries (two points of the affine fit)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bundled_entries(model: Path, reps: int = 3, lengths: tuple[int, int] = LENGTHS) -> dict:
    """Bytes of real entries of `model` per format, fitted as linear + per_token x tokens, the build
    time per token and each format's parse time per byte (best of `reps`, this machine)."""
    from common.engine.hybrid_engine import HybridEngine
    from common.engine.pic.entry import SegmentEntry

    engine = HybridEngine.for_worker(model, "float32", "cpu", entry_format="fp32")  # written in each format below
    rng = random.Random(0)
    sizes = {f: [] for f in ENTRY_FORMATS}
    parse = {f: [] for f in ENTRY_FORMATS}
    builds = []
    for n in lengths:
        ids = [rng.randrange(engine.vocab_size) for _ in range(n)]
        entry = None

        def build() -> None:
            nonlocal entry
            entry = engine.build_entry(ids, SEAM)
        builds.append(_best(build, reps))
        for f in ENTRY_FORMATS:
            data = entry.with_format(f).to_bytes()
            sizes[f].append(len(data))
            parse[f].append(_best(lambda: SegmentEntry.from_bytes(data), reps) / len(data))
    span = lengths[1] - lengths[0]
    out = {"source": f"measured: {model.name}", "build_s_per_token": (builds[1] - builds[0]) / span,
           "build_s_intercept": builds[0] - (builds[1] - builds[0]) / span * lengths[0]}
    for f in ENTRY_FORMATS:
        per_token = (sizes[f][1] - sizes[f][0]) / span
        out[f] = {"linear": sizes[f][0] - per_token * lengths[0], "per_token": per_token,
                  "parse_s_per_byte": statistics.median(parse[f])}
    return out


def arch_entries(name: str = ARCH) -> dict:
    """bench.entry_bytes' bytes of `name`'s entries (bf16 model dtype) in the same form."""
    from bench.entry_bytes import entry_table

    [row] = entry_table(tokens=1000, dtype_bytes=2, names=[name])
    out = {"source": f"bench.entry_bytes: {name} (config, bf16 KV)", "build_s_per_token": None}
    for f in ENTRY_FORMATS:  # K/V per token as the format stores them (fp8: e4m3 + a scale per token and head)
        out[f] = {"linear": row[f"linear_per_segment_{f}"], "per_token": row[f"attn_kv_{f}"] / 1000,
                  "parse_s_per_byte": None}
    return out


def entry_size(model: dict, fmt: str, tokens: int) -> int:
    return int(model[fmt]["linear"] + model[fmt]["per_token"] * tokens)


def replay_costs(trace: W.Trace, sizes: dict[int, int], capacity: int, warm: int) -> dict:
    """One cache of `capacity` bytes over the trace: hit rates, and per request (after `warm`) the
    bytes its hits move and the tokens its misses rebuild."""
    tier = SimTier(capacity)
    hits = lookups = hit_tokens = tokens = hit_bytes = miss_tokens = counted = 0
    for r in trace.requests:
        for doc, seg in zip(r.doc_ids, r.segments):
            hit = tier.access(f"doc-{doc}", sizes[doc], float(len(seg)))
            if r.index >= warm:
                lookups += 1
                tokens += len(seg)
                hits += hit
                hit_tokens += len(seg) if hit else 0
                hit_bytes += sizes[doc] if hit else 0
                miss_tokens += 0 if hit else len(seg)
        counted += r.index >= warm
    n = max(counted, 1)
    return {"hit_rate": hits / max(lookups, 1), "token_hit_rate": hit_tokens / max(tokens, 1),
            "hit_bytes_per_request": hit_bytes / n, "miss_tokens_per_request": miss_tokens / n}


def read_rates(path: Path, override: float | None) -> dict:
    """gRPC and NIXL read rates (GB/s): --transfer-gbps for both, else the medians over entry sizes
    of bench/segcache.py's last run."""
    if override:
        return {"grpc_gbps": override, "nixl_gbps": override, "source": "--transfer-gbps"}
    rows = json.loads(path.read_text())["rows"]
    return {"grpc_gbps": statistics.median(r["grpc_4mib_gbps"] for r in rows),
            "nixl_gbps": statistics.median(r["nixl_gbps"] for r in rows),
            "source": f"{path.relative_to(REPO)}: medians of grpc_4mib_gbps, nixl_gbps"}


def study(model: dict, corpus: list, trace: W.Trace, warm: int, rates: dict) -> list[dict]:
    """Rows per (budget fraction, format) for one entry model."""
    fp32_bytes = sum(entry_size(model, "fp32", d.n_tokens) for d in corpus)
    rows = []
    for frac in FRACTIONS:
        budget = int(frac * fp32_bytes)
        for f in ENTRY_FORMATS:
            sizes = {d.id: entry_size(model, f, d.n_tokens) for d in corpus}
            r = replay_costs(trace, sizes, budget, warm)
            parse = model[f]["parse_s_per_byte"]
            parse_s = r["hit_bytes_per_request"] * parse if parse is not None else 0.0
            grpc_s = r["hit_bytes_per_request"] / (rates["grpc_gbps"] * 1e9) + parse_s
            nixl_s = r["hit_bytes_per_request"] / (rates["nixl_gbps"] * 1e9) + parse_s
            build = model["build_s_per_token"]
            rebuild_s = r["miss_tokens_per_request"] * build if build is not None else None
            rows.append({"budget_fraction": frac, "budget_bytes": budget, "format": f,
                         "mean_entry_bytes": sum(sizes.values()) / len(sizes), **r,
                         "parse_s_per_request": parse_s, "transfer_grpc_s_per_request": grpc_s,
                         "transfer_nixl_s_per_request": nixl_s, "rebuild_s_per_request": rebuild_s,
                         "ttft_est_grpc_s": None if rebuild_s is None else rebuild_s + grpc_s,
                         "ttft_est_nixl_s": None if rebuild_s is None else rebuild_s + nixl_s})
    return rows


def run_formats(args: argparse.Namespace) -> dict:
    corpus, trace = rag(args)
    rates = read_rates(REPO / "bench" / "results" / "segcache.json", getattr(args, "transfer_gbps", None))
    models = {"bundled": bundled_entries(Path(args.model) if args.model else DEFAULT_MODEL), ARCH: arch_entries()}
    return {"bench": "segcache_capacity_formats", "requests": len(trace), "warm": args.warm,
            "corpus_docs": len(corpus), "trace": trace.summary(), "policy": "gdsf", "rates": rates,
            "entry_models": models,
            "studies": {name: study(m, corpus, trace, args.warm, rates) for name, m in models.items()},
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def table_formats(result: dict) -> str:
    lines = [f"entry formats at equal cache budgets (fraction of the corpus's fp32 entry bytes); RAG trace, "
             f"{result['requests']} requests, GDSF; transfer at {result['rates']['grpc_gbps']:.3f} GB/s gRPC "
             f"({result['rates']['source']})"]
    for name, rows in result["studies"].items():
        lines.append(f"{name} ({result['entry_models'][name]['source']})")
        lines.append(f"{'budget':>8} {'format':>6} {'entry KiB':>9} {'hit rate':>8} {'tok hit':>8} "
                     f"{'MiB/req':>8} {'xfer ms':>8} {'rebuild ms':>10} {'TTFT est ms':>11}")
        for r in rows:
            ms = (lambda v: "-" if v is None else f"{v * 1e3:.1f}")
            lines.append(f"{r['budget_fraction']:>8.4f} {r['format']:>6} {r['mean_entry_bytes'] / 1024:>9.0f} "
                         f"{r['hit_rate']:>8.3f} {r['token_hit_rate']:>8.3f} "
                         f"{r['hit_bytes_per_request'] / 2**20:>8.2f} {ms(r['transfer_grpc_s_per_request']):>8} "
                         f"{ms(r['rebuild_s_per_request']):>10} {ms(r['ttft_est_grpc_s']):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_formats(args)
    print(table_formats(result))
    (args.out / "segcache_capacity_formats.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}/segcache_capacity_formats.json")
    return result


if __name__ == "__main__":
    main()
