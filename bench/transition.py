"""Cost of building segment summaries (T_C, S(C|0)) vs the plain chunked prefill, per family.

    python -m bench.transition [--lengths 512 1024 2048 4096 8192] [--H 4 --K 64 --V 64] [--reps 3]

For each family and segment length it times, on the torch chunk path (CPU here):
  prefill  linear_attention over the segment -> (o, S)                  (what a prefill costs)
  fused    prefill_with_summary -> (o, S, T) in one pass                 (what a scatter worker runs)
  summary  segment_summary -> (T, S) without outputs
and reports fused/prefill - 1 (the overhead of caching T during a prefill) and summary/prefill, each
the median over rounds of the paired ratio (times are the best round).
Then the time to compose n = 64 cached segments (compose_batched, one layer, all heads) vs the
chunked prefill of the 64 segments' tokens that the composition replaces.
Then, at model level (`--model`, the bundled model by default, and `--random-model`, a
random-weight model of a realistic shape, timing only): a plain prefill of a segment (one
forward) vs build_entry (the same forward with the fused kernel in every linear layer: what a
scatter worker runs) vs build_entry_reference (forward, then features, summary and conv inputs
again), seam 8; overhead = build/prefill - 1.
Timings interleave the variants and keep the best of --reps runs; by default one thread and the
process CPU clock, which stays meaningful when other jobs share the cores (--clock wall for wall time).
Writes bench/results/transition.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.driver import CLOCKS, add_clock_arg, best_of
from bench.random_model import RANDOM_LABEL, describe, parse_spec, save_random_model
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.reference import build_entry_reference
from kernels.compose import compose_batched, stack_summaries
from kernels.linear_attn import (
    DELTA_FAMILIES,
    FAMILIES,
    FAMILY_GATE,
    linear_attention,
    prefill_with_summary,
    segment_summary,
)


def make_inputs(family, T, H, K, V, gen):
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    if family in DELTA_FAMILIES:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    gate = FAMILY_GATE[family]
    g = None
    if gate == "head":
        g = -torch.rand(H, generator=gen) * 0.1
    elif gate == "token":
        g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3.0)
    elif gate == "channel":
        g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 4.0)
    beta = torch.rand(1, T, H, generator=gen) if family in DELTA_FAMILIES else None
    return q, k, v, g, beta


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-compose", type=int, default=64)
    ap.add_argument("--compose-seg-len", type=int, default=512)
    ap.add_argument("--json", default="bench/results/transition.json")
    ap.add_argument("--model", default="models/hypic-tiny-qwen35", help="checkpoint for the model-level rows")
    ap.add_argument("--random-model", default="hidden=1024,layers=16,ratio=3:1",
                    help="spec of a random-weight model for the model-level rows (bench.random_model); '' skips")
    ap.add_argument("--model-lengths", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--model-reps", type=int, default=5)
    ap.add_argument("--skip-kernels", action="store_true", help="model-level rows only")
    ap.add_argument("--threads", type=int, default=1)
    add_clock_arg(ap)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(0)
    H, K, V = a.H, a.K, a.V
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.clock} clock, H={H} K={K} V={V}, "
          f"B=1, fp32, load avg {os.getloadavg()[0]:.2f}")
    # warm the allocator (heap growth / page faults) at the largest shape before timing anything
    for fam in a.families:
        q, k, v, g, beta = make_inputs(fam, max(a.lengths), H, K, V, gen)
        prefill_with_summary(fam, q, k, v, g=g, beta=beta)
        linear_attention(fam, q, k, v, g=g, beta=beta)
    model_rows = model_level(a)
    rows = []
    if a.skip_kernels:
        a.families = []
    hdr = f"{'family':<15}{'T':>6}{'prefill ms':>12}{'fused ms':>10}{'summary ms':>12}{'fused ovh':>11}{'summ/prefill':>14}"
    print(hdr)
    print("-" * len(hdr))
    for fam in a.families:
        for T in a.lengths:
            q, k, v, g, beta = make_inputs(fam, T, H, K, V, gen)
            fns = {
                "prefill": lambda: linear_attention(fam, q, k, v, g=g, beta=beta),
                "fused": lambda: prefill_with_summary(fam, q, k, v, g=g, beta=beta),
                "summary": lambda: segment_summary(fam, k, v, g=g, beta=beta),
            }
            t = best_of(fns, a.reps, ratios=(("fused", "prefill"), ("summary", "prefill")),
                        clock=CLOCKS[a.clock])
            row = dict(family=fam, T=T, H=H, K=K, V=V, prefill_s=t["prefill"], fused_s=t["fused"],
                       summary_s=t["summary"], fused_overhead=t["fused/prefill"] - 1,
                       summary_over_prefill=t["summary/prefill"])
            rows.append(row)
            print(f"{fam:<15}{T:>6}{t['prefill']*1e3:>12.2f}{t['fused']*1e3:>10.2f}{t['summary']*1e3:>12.2f}"
                  f"{100*row['fused_overhead']:>10.1f}%{100*row['summary_over_prefill']:>13.1f}%")

    comp_rows = compose_rows(a, gen)
    if a.json:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), clock=a.clock, H=H, K=K, V=V,
                           loadavg=os.getloadavg()[0], build=rows, compose=comp_rows, model_build=model_rows),
                      f, indent=1)
        print(f"\nwrote {a.json}")
    return rows, comp_rows


def compose_rows(a, gen: torch.Generator) -> list[dict]:
    """Composing n cached segments' summaries (one layer) vs prefilling their tokens, per family."""
    H, K, V = a.H, a.K, a.V
    comp_rows = []
    n, L = a.n_compose, a.compose_seg_len
    print(f"\ncompose n={n} cached segments of {L} tokens (one layer, {H} heads) vs prefilling their {n*L} tokens")
    hdr2 = f"{'family':<15}{'form':>8}{'compose ms':>12}{'per seg us':>12}{'prefill ms':>12}{'speedup':>10}"
    print(hdr2)
    print("-" * len(hdr2))
    for fam in a.families:
        q, k, v, g, beta = make_inputs(fam, n * L, H, K, V, gen)
        sl = lambda x, i: None if x is None else (x if x.dim() == 1 else x[:, i * L : (i + 1) * L])
        sums = [segment_summary(fam, sl(k, i), sl(v, i), g=sl(g, i), beta=sl(beta, i)) for i in range(n)]
        Ts, Ss, form = stack_summaries(sums)
        S_in = torch.randn(Ss.shape[1:], generator=gen)
        t = best_of({
            "compose": lambda: compose_batched(Ts, Ss, S_in, form=form),
            "prefill": lambda: linear_attention(fam, q, k, v, g=g, beta=beta),
        }, a.reps, clock=CLOCKS[a.clock])
        r = dict(family=fam, form=form, n=n, seg_len=L, compose_s=t["compose"], prefill_s=t["prefill"],
                 speedup=t["prefill"] / t["compose"])
        comp_rows.append(r)
        print(f"{fam:<15}{form:>8}{t['compose']*1e3:>12.3f}{t['compose']/n*1e6:>12.1f}{t['prefill']*1e3:>12.1f}"
              f"{r['speedup']:>9.0f}x")
    return comp_rows


def model_level(a) -> list[dict]:
    """build_entry (fused) and build_entry_reference vs a plain prefill, per model and length."""
    models = [(a.model, Path(a.model).name)] if a.model else []
    tmp = tempfile.TemporaryDirectory()
    if a.random_model:
        spec = parse_spec(a.random_model)
        models.append((str(save_random_model(spec, Path(tmp.name) / "random")), describe(spec)))
    rows = []
    hdr = f"{'model':<60}{'T':>6}{'prefill ms':>12}{'build ms':>10}{'ref ms':>10}{'build ovh':>11}{'ref ovh':>9}"
    print(hdr)
    print("-" * len(hdr))
    for path, label in models:
        eng = HybridEngine.from_pretrained(path)
        gen = torch.Generator().manual_seed(1)
        for T in a.model_lengths:
            ids = torch.randint(0, eng.vocab_size, (T,), generator=gen).tolist()
            fns = {
                "prefill": lambda: eng.forward(ids),
                "build": lambda: build_entry(eng, ids, 8),
                "reference": lambda: build_entry_reference(eng, ids, 8),
            }
            t = best_of(fns, a.model_reps, ratios=(("build", "prefill"), ("reference", "prefill")),
                        clock=CLOCKS[a.clock])
            row = dict(model=label, random_weights=RANDOM_LABEL in label, T=T, seam=8, prefill_s=t["prefill"],
                       build_s=t["build"], reference_s=t["reference"], build_overhead=t["build/prefill"] - 1,
                       reference_overhead=t["reference/prefill"] - 1)
            rows.append(row)
            print(f"{label[:59]:<60}{T:>6}{t['prefill']*1e3:>12.1f}{t['build']*1e3:>10.1f}{t['reference']*1e3:>10.1f}"
                  f"{100*row['build_overhead']:>10.1f}%{100*row['reference_overhead']:>8.1f}%", flush=True)
        del eng
    tmp.cleanup()
    print()
    return rows


if __name__ == "__main__":
    main()
