"""Prefill throughput: our engine vs transformers' forward, same checkpoint, same prompt, one run.

    python -m bench.prefill [--tokens 2048] [--repeats 3] [--arch qwen3_5_text ...]

Prints a table and writes bench/results/prefill.json. Both sides run fp32 on the CPU with the
same thread count; the first call of each is a warm-up and not timed.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.driver import best
from common.engine.hybrid_engine import HybridEngine

CONFIGS = {
    "qwen3_5_text": dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64,
    ),
    "qwen3_next": dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=512,
    ),
    "kimi_linear": None,  # filled from tests' tiny configs when present (see main)
    "nemotron_h": None,
}


def bench_arch(arch: str, cfg: dict, tokens: int, repeats: int, workdir: Path) -> dict:
    torch.manual_seed(0)
    hf_cfg = AutoConfig.for_model(arch, **cfg)
    hf = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    path = workdir / arch
    hf.save_pretrained(path)
    eng = HybridEngine.from_pretrained(path)
    ids = torch.randint(0, hf_cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    x = torch.tensor([ids])

    def run_hf():
        with torch.inference_mode():
            hf(x, use_cache=True, logits_to_keep=1)

    def run_ours():
        eng.prefill(ids)

    t_hf = best(run_hf, repeats, warm_up=True)[0]
    t_ours = best(run_ours, repeats, warm_up=True)[0]
    params = sum(p.numel() for p in hf.parameters())
    return dict(arch=arch, params=params, tokens=tokens, transformers_s=t_hf, hypic_s=t_ours,
                transformers_tok_s=tokens / t_hf, hypic_tok_s=tokens / t_ours, speedup=t_hf / t_ours)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arch", nargs="*", default=["qwen3_5_text", "qwen3_next"])
    ap.add_argument("--out", default="bench/results/prefill.json")
    args = ap.parse_args(argv)
    torch.set_flush_denormal(True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for arch in args.arch:
            cfg = CONFIGS.get(arch)
            if cfg is None:
                print(f"skip {arch}: no benchmark config")
                continue
            rows.append(bench_arch(arch, cfg, args.tokens, args.repeats, Path(d)))
    print(f"{'arch':<14}{'params':>10}{'tokens':>8}{'transformers tok/s':>20}{'hypic tok/s':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['arch']:<14}{r['params'] / 1e6:>9.1f}M{r['tokens']:>8}{r['transformers_tok_s']:>20.0f}"
              f"{r['hypic_tok_s']:>14.0f}{r['speedup']:>7.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(threads=torch.get_num_threads(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
