"""TTFT of full recompute vs prefix cache vs additive PIC vs hypic, n segments of 512 tokens, in-process.

    python -m bench.reuse [--n 4 8 16 32 64] [--seg-len 512] [--repeats 2]

Every mode runs on the same prompts in one run. The cache-dependent modes are warm: hypic and additive
get their entries from memory, and the prefix cache has seen the same documents in another order
before (the RAG case: retrieved documents rarely come back in the same order), so it reuses only the
longest common segment-aligned prefix. Writes bench/results/reuse.json and reuse.png.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.driver import best
from bench.plots import pyplot
from bench.random_model import RANDOM_LABEL, config_kwargs, describe, parse_spec, save_random_model
from bench.report_baseline import best as best_baseline
from common.engine.hybrid_engine import HybridEngine
from common.engine.modes import LABELS, MODES

CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64,
)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="*", default=[4, 8, 16, 32, 64])
    ap.add_argument("--seg-len", type=int, default=512)
    ap.add_argument("--query-len", type=int, default=16)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="default bench/results/reuse.json (reuse_random.json with "
                                                "--random-model)")
    ap.add_argument("--random-model", default="", metavar="SPEC",
                    help="a random-weight model of a realistic shape instead of CONFIG, e.g. "
                         "hidden=1024,layers=16,ratio=3:1 (bench.random_model; timing only, labelled so)")
    args = ap.parse_args(argv)
    args.out = args.out or f"bench/results/reuse{'_random' if args.random_model else ''}.json"
    torch.set_flush_denormal(True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        if args.random_model:
            spec = parse_spec(args.random_model)
            save_random_model(spec, Path(d))
            model = dict(spec=spec, description=describe(spec), random_weights=RANDOM_LABEL,
                         config=config_kwargs(spec))
        else:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **CONFIG)).save_pretrained(d)
            model = dict(config=CONFIG, random_weights=RANDOM_LABEL)
        print(f"model: {model.get('description', f'{CONFIG} ({RANDOM_LABEL})')}", flush=True)
        eng = HybridEngine.from_pretrained(d)
        rng = random.Random(0)
        for n in args.n:
            docs = [[rng.randrange(eng.vocab_size) for _ in range(args.seg_len)] for _ in range(n)]
            query = [rng.randrange(eng.vocab_size) for _ in range(args.query_len)]
            entries = {m: eng.prefill_segments(docs, query, mode=m, seam=args.seam).extra["entries"]
                       for m in ("hypic", "additive")}
            order = list(range(n))
            seen = order[:]
            rng.shuffle(seen)
            eng.prefix_cache.clear()
            eng.prefill_segments([docs[i] for i in seen], query, mode="prefix")  # earlier request
            segs = [docs[i] for i in order]
            row = dict(n=n, seg_len=args.seg_len, prompt_tokens=n * args.seg_len + args.query_len)
            row["full_s"], full = best(lambda: eng.prefill_segments(segs, query, mode="full"), args.repeats)
            row["prefix_s"], pre = best(lambda: eng.prefill_segments(segs, query, mode="prefix"), 1)
            row["prefix_nothing_cached_s"], _ = best(lambda: (eng.prefix_cache.clear(), eng.prefill_segments(
                segs, query, mode="prefix"))[1], args.repeats)  # the baseline's own overhead over full
            row["prefix_nothing_cached_over_full"] = row["prefix_nothing_cached_s"] / row["full_s"]
            row["prefix_reused_segments"] = pre.extra["reused_segments"]
            row["additive_s"], _ = best(
                lambda: eng.prefill_segments(segs, query, entries=entries["additive"], mode="additive"), args.repeats)
            row["hypic_s"], hyp = best(
                lambda: eng.prefill_segments(segs, query, entries=entries["hypic"], mode="hypic", seam=args.seam),
                args.repeats)
            row["hypic_layer_major_s"], _ = best(
                lambda: eng.prefill_segments(segs, query, entries=entries["hypic"], mode="hypic", seam=args.seam,
                                             order="layer"), args.repeats)
            p, q = torch.log_softmax(full.logits.double(), -1), torch.log_softmax(hyp.logits.double(), -1)
            row["hypic_kl"] = float((p.exp() * (p - q)).sum())
            # against the faster of the two baselines at this n, named (bench/report_baseline.py)
            row["best_baseline"], base_s = best_baseline({"full": row["full_s"], "prefix": row["prefix_s"]})
            row["speedup_vs_best"] = base_s / row["hypic_s"]
            rows.append(row)
            print(f"n={n:>3}  full {row['full_s']*1e3:8.1f} ms  prefix {row['prefix_s']*1e3:8.1f} ms "
                  f"(reused {row['prefix_reused_segments']}; "
                  f"nothing cached x{row['prefix_nothing_cached_over_full']:.2f} "
                  f"full)  additive {row['additive_s']*1e3:7.1f} ms  "
                  f"hypic {row['hypic_s']*1e3:7.1f} ms  (layer-major {row['hypic_layer_major_s']*1e3:7.1f} ms)  "
                  f"x{row['speedup_vs_best']:.1f} vs {row['best_baseline']} (the faster baseline)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(config=model["config"], model=model, threads=torch.get_num_threads(), rows=rows),
                              indent=2))
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(rows, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["n"] for r in rows]
    for mode in MODES:
        key, label = f"{mode}_s", LABELS[mode]
        ax.plot(ns, [r[key] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"segments of {rows[0]['seg_len']} tokens")
    ax.set_ylabel("TTFT (ms, CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
