"""The prefix-cache baseline's cost with nothing to reuse, against full recompute, per prompt shape.

    python -m bench.prefix_pass [--model models/hypic-tiny-qwen35] [--shapes 8x60 16x250 6x660] [--repeats 7]

A prefix cache keeps the model state at every segment boundary; with nothing cached it still has
to compute them. Per shape (segments x tokens each, lengths +-12%), interleaved, medians of
--repeats after a warm-up, one thread:

    full         engine.prefill of the whole prompt (what full recompute runs)
    one pass     common.engine.pic.prefix.forward_segments: the pass the baseline runs, states kept
                 at every segment end (kernels.linear_attn.segments)
    per segment  one engine.forward per segment from the previous state (the plain way to get
                 those states)
    request      prefill_segments(mode="prefix") on a fresh prompt (query included, states cached,
                 the cache filling up as it would in a worker) against mode="full"

Prints a table and writes bench/results/prefix_pass.json (ratios against full).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.prefix import forward_segments

ROOT = Path(__file__).resolve().parents[1]


def shape_prompts(rng: random.Random, vocab: int, n: int, length: int, count: int):
    def seg():
        return [rng.randrange(10, vocab) for _ in range(max(1, length + rng.randint(-length // 8, length // 8)))]
    return [([seg() for _ in range(n)], [rng.randrange(10, vocab) for _ in range(12)]) for _ in range(count)]


def per_segment(engine, segs):
    state = None
    for s in segs:
        _, _, state = engine.forward(s, state)
    return state


@torch.inference_mode()
def bench_shape(engine, n: int, length: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = min(engine.vocab_size, 4096)
    segs, _ = shape_prompts(rng, vocab, n, length, 1)[0]
    ids = [t for s in segs for t in s]
    runs = {"full": lambda: engine.prefill(ids), "one_pass": lambda: forward_segments(engine, segs, None),
            "per_segment": lambda: per_segment(engine, segs)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    # whole requests with nothing to reuse: a fresh prompt each, both modes on it, order alternating
    engine.prefix_cache.clear()
    req: dict[str, list[float]] = {"full": [], "prefix": []}
    for i, (s, q) in enumerate(shape_prompts(rng, vocab, n, length, repeats + 1)):
        for m in ("full", "prefix") if i % 2 else ("prefix", "full"):
            t = time.perf_counter()
            engine.prefill_segments(s, q, mode=m)
            if i:  # the first pair warms up
                req[m].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    rmed = {k: sorted(v)[len(v) // 2] for k, v in req.items()}
    return {"segments": n, "tokens_per_segment": length, "prompt_tokens": len(ids),
            "full_s": med["full"], "one_pass_s": med["one_pass"], "per_segment_s": med["per_segment"],
            "one_pass_over_full": med["one_pass"] / med["full"], "per_segment_over_full": med["per_segment"] / med["full"],
            "request_full_s": rmed["full"], "request_prefix_s": rmed["prefix"],
            "request_prefix_over_full": rmed["prefix"] / rmed["full"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "hypic-tiny-qwen35")
    ap.add_argument("--shapes", nargs="+", default=["8x60", "16x250", "6x660"], help="SEGMENTSxTOKENS")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_pass.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    engine = HybridEngine.from_pretrained(args.model)
    rows = []
    print(f"{'shape':>8} {'tokens':>6} {'full ms':>8} {'one pass':>14} {'per segment':>14} {'request prefix/full':>20}")
    for shape in args.shapes:
        n, length = (int(x) for x in shape.split("x"))
        r = bench_shape(engine, n, length, args.repeats, args.seed)
        rows.append(r)
        print(f"{shape:>8} {r['prompt_tokens']:>6} {1e3 * r['full_s']:>8.1f} "
              f"{1e3 * r['one_pass_s']:>7.1f} {r['one_pass_over_full']:>5.2f}x {1e3 * r['per_segment_s']:>7.1f} "
              f"{r['per_segment_over_full']:>5.2f}x {r['request_prefix_over_full']:>19.3f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model.relative_to(ROOT)) if args.model.is_relative_to(ROOT)
                                    else str(args.model), "threads": 1, "repeats": args.repeats,
                                    "shapes": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
