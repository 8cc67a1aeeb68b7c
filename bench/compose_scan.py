"""Composition of a run of entries, one pass per layer (the run kernel) against segment by segment.

    python -m bench.compose_scan [--n 8 32] [--seg-len 32] [--seam 8] [--repeats 5]

The layer-major pass (common.engine.pic.seam_plan.SeamPlan) composes each linear layer's run in
one kernels.compose.compose_run_states call: every seam's summary in one batched call, the run's
2n summaries composed in one pass (one Triton launch on CUDA), every seam's outputs in one batched
call. Runs whose bodies hold T as factors (short segments: kernels.linear_attn.lowrank) and
lightning attention's per-head decays (MiniMax) used to go segment by segment
(SeamPlan._scan_one_by_one, kept as the reference); this measures both paths on the same entries
in one run, in-process on CPU (the torch path), and checks they compose the same state:

- "factored": the mid-size random Qwen3.5-pattern model (bench.random_model, K = 64), segments
  of `--seg-len` tokens, so that every linear layer's body holds T as factors;
- "dense": the same model, segments of 8 x `--seg-len` tokens (dense T: the run path it had before);
- "minimax": a random MiniMax (lightning attention) model of hidden 512.

Writes bench/results/compose_scan.json.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, MiniMaxConfig

import common.engine.pic.seam_plan as seam_plan
from bench.driver import best
from bench.random_model import RANDOM_LABEL, describe, parse_spec, save_random_model
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.reuse import compose_run

MID_SPEC = "hidden=1024,layers=16,ratio=3:1"
MINIMAX = dict(vocab_size=4096, hidden_size=512, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, block_size=64,
               layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2)


def state_rel(a, b) -> float:
    """Largest norm-relative difference over the two states' recurrent states."""
    worst = 0.0
    for x, y in zip(a.layers, b.layers):
        if getattr(x, "recurrent", None) is not None:
            worst = max(worst, float((x.recurrent.double() - y.recurrent.double()).norm() / y.recurrent.double().norm()))
    return worst


def measure(eng: HybridEngine, case: str, n: int, seg_len: int, seam: int, repeats: int, rng: random.Random) -> dict:
    segs = [[rng.randrange(eng.vocab_size) for _ in range(seg_len)] for _ in range(n)]
    entries = [build_entry(eng, s, seam) for s in segs]
    factored = sum(len(e.lowrank_layers) for e in entries)
    run_s, run_state = best(lambda: compose_run(eng, eng.new_state(), entries), repeats)
    with mock.patch.object(seam_plan, "run_composable", lambda bodies: False):  # the path before
        one_s, one_state = best(lambda: compose_run(eng, eng.new_state(), entries), repeats)
    row = dict(case=case, n=n, seg_len=seg_len, seam=seam, factored_layer_bodies=factored,
               run_s=run_s, one_by_one_s=one_s, speedup=one_s / run_s, state_rel=state_rel(run_state, one_state))
    print(f"{case:>8} n={n:>3} x {seg_len:>4} tokens  run {run_s * 1e3:8.1f} ms  segment by segment "
          f"{one_s * 1e3:8.1f} ms  x{row['speedup']:.2f}  (factored bodies {factored}, state rel {row['state_rel']:.1e})",
          flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--seg-len", type=int, default=32, help="short enough for factored T (K = 64: span <= 31)")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/compose_scan.json")
    args = ap.parse_args(argv)
    torch.set_flush_denormal(True)
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        spec = parse_spec(MID_SPEC)
        mid = HybridEngine.from_pretrained(save_random_model(spec, Path(d) / "mid"))
        print(f"model: {describe(spec)}", flush=True)
        for n in args.n:
            rows.append(measure(mid, "factored", n, args.seg_len, args.seam, args.repeats, rng))
            rows.append(measure(mid, "dense", n, 8 * args.seg_len, args.seam, args.repeats, rng))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(MiniMaxConfig(**MINIMAX)).save_pretrained(Path(d) / "minimax")
        mm = HybridEngine.from_pretrained(Path(d) / "minimax")
        for n in args.n:
            rows.append(measure(mm, "minimax", n, 8 * args.seg_len, args.seam, args.repeats, rng))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(models=dict(mid=dict(spec=spec, description=describe(spec)), minimax=MINIMAX),
                                   random_weights=RANDOM_LABEL, threads=torch.get_num_threads(), rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
