"""The offline drift figures the online shadow monitor is compared with (issue 26, item 4).

    python -m bench.quality.drift_offline [--model models/hypic-tiny-qwen35] [--out bench/quality/results]

For hypic with the router's default seam (w=8), OFFLINE_PER_TASK held-out prompts of every task
(the first ones of bench.quality.tasks.eval_prompt, the prompts quality.json starts with) go through
`HybridEngine.prefill_segments`, are decoded greedily for OFFLINE_STEPS (16) tokens, and are measured
against full recompute with common.engine.drift.measure_drift, the function the combine service's
Shadow RPC applies: KL(full || hypic) at the query, top-1 agreement there and the fraction of the
16 teacher-forced steps whose argmaxes agree. The file keeps every prompt as token ids (one list per
document segment, then the query), hypic's greedy tokens and the figures, so that a system test can
send the same prompts through the mesh with shadow sampling at 100% and compare the monitor's
figures with these, prompt by prompt or as means.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.quality import eval as E
from bench.quality import tasks as T
from common.engine.drift import measure_drift

FILE = "drift_offline.json"


def offline_prompt(engine, task: str, index: int, seam: int, steps: int) -> dict:
    """One prompt's ids, hypic's greedy tokens and its drift figures."""
    segments, query, answer = E.prompt_ids(engine, task, index)
    out = engine.prefill_segments(segments, query, mode="hypic", seam=seam)
    tokens, _ = E.greedy(engine, out, steps)
    drift = measure_drift(engine, [t for s in segments for t in s] + query, tokens, tokens, out.logits)
    return {"task": task, "index": index, "segments": segments, "query": query, "answer": answer,
            "generated": tokens, "kl": drift.kl, "top1_agree": drift.top1_agree, "agreement": drift.agreement,
            "steps": drift.steps}


def drift_offline(model: Path, per_task: int = E.OFFLINE_PER_TASK, seam: int = E.OFFLINE_SEAM,
                  steps: int = E.OFFLINE_STEPS, tasks=T.TASKS, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    engine = E.load_engine(model)
    t0 = time.perf_counter()
    prompts = [offline_prompt(engine, t, i, seam, steps) for t in tasks for i in range(per_task)]
    n = len(prompts)
    kl_mean = sum(p["kl"] for p in prompts) / n
    agree_mean, agree_lo, agree_hi = E.mean_interval([p["agreement"] for p in prompts])
    top1 = sum(p["top1_agree"] for p in prompts)
    return {
        "model": str(model),
        "fingerprint": engine.fingerprint,
        "mode": "hypic",
        "seam": seam,
        "steps": steps,
        "greedy": True,
        "n_prompts": n,
        "summary": {
            "kl_mean": kl_mean,
            "kl_interval95": list(E.mean_interval([p["kl"] for p in prompts])[1:]),
            "top1_agree": top1 / n,
            "top1_interval95": [x / 100.0 for x in E.wilson(top1, n)],
            "agreement_mean": agree_mean,
            "agreement_interval95": [agree_lo, agree_hi],
        },
        "prompts": prompts,
        "eval_s": round(time.perf_counter() - t0, 1),
    }


def write(model: Path, path: Path, **kw) -> dict:
    res = drift_offline(model, **kw)
    try:
        res["model"] = str(Path(model).resolve().relative_to(E.ROOT))
    except ValueError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=None, separators=(",", ":")).replace(',{"task"', ',\n{"task"') + "\n")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=E.DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=E.DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    res = write(args.model, args.out / FILE, threads=args.threads)
    print(json.dumps(res["summary"]), f"\n{res['eval_s']:.0f} s -> {args.out / FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
