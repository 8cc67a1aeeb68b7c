"""Quality of position-independent caching: exact-match accuracy per task and per prefill mode.

    python -m bench.quality.eval [--model models/hypic-tiny-qwen35] [--n 500] [--out bench/quality/results]

Every held-out prompt (bench.quality.tasks.eval_prompt: 8 documents, ~450 tokens, one query) goes
through `HybridEngine.prefill_segments` in each mode, then greedy decoding of as many tokens as
the answer has; a prompt counts when every decoded token is right.

    full        the whole prompt recomputed (the reference)
    prefix      prefix caching: an earlier request with the first half of the documents left their
                segment-aligned states in the cache; this one reuses them and computes the rest
                (exact by construction; the reuse count is checked and recorded)
    additive    cached segment states added without T, no seams (the ablation; "naive" in results
                written before the rename, which bench.results_json reads as "additive")
    hypic_w{w}  Hypic with a seam window of w tokens, w in 0, 2, 4, 8, 16

With --cut (written to quality_cut.json / quality_cut.md instead): the cost of cutting long
segments. The prompt's documents are joined into one long document (~450 tokens), then cached
    cut_whole   as one entry (the router's keep_whole), or
    cut{L}      cut into pieces of <= L tokens by common.engine.cut.cut_segment, the function the
                router applies, L in 64, 128, 256 (512 leaves ~450 tokens whole: cut_whole),
each with hypic's default seam window (8), against full recompute of the same tokens.

Segment entries are built once per prompt and seam width and reused: hypic w=0 and additive share
the same entries (both have no seam). Deterministic: no sampling, fixed prompts; the numbers do
not depend on --workers.
Writes quality.json (accuracies, every prompt's correctness per mode, and the first prompts'
predictions with their logit margins, which tests/bench/test_quality_replay.py replays), quality.md and
quality.png.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.plots import pyplot
from bench.quality import tasks as T
from common.engine.cut import cut_segment
from common.engine.hybrid_engine import HybridEngine
from common.engine.modes import LABELS
from common.engine.modes import MODES as PREFILL_MODES

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "hypic-tiny-qwen35"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SEAMS = (0, 2, 4, 8, 16)
MODES = tuple(m for m in PREFILL_MODES if m != "hypic") + tuple(f"hypic_w{w}" for w in SEAMS)
CUT_LENGTHS = (64, 128, 256)
CUT_SEAM = 8
CUT_MODES = ("full", "cut_whole") + tuple(f"cut{L}" for L in CUT_LENGTHS)
DETAIL = 50  # prompts per task whose predictions and margins are stored (what the test replays)


def load_engine(model: Path):
    return HybridEngine.from_pretrained(model, dtype=torch.float32, device="cpu")


def encode(engine, words: list[str]) -> list[int]:
    return engine.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]


def prompt_ids(engine, task: str, index: int):
    world, q = T.eval_prompt(task, index)
    segments = [encode(engine, d) for d in world.docs]
    return segments, encode(engine, q.words), encode(engine, q.answer)


def decode(engine, out, n: int) -> tuple[list[int], float]:
    """Greedy decoding of n tokens from a PrefillOutput; also the smallest top-1/top-2 logit margin
    seen (a near-tie could flip under another float summation order)."""
    tokens, logits, state, margin = [], out.logits, out.state, float("inf")
    for i in range(n):
        top = torch.topk(logits.float(), 2).values
        margin = min(margin, float(top[0] - top[1]))
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if i < n - 1:
            logits, state = engine.decode_step(tok, state)
    return tokens, margin


def run_prompt(engine, segments, query, answer, modes=MODES, order: str = "layer") -> dict[str, dict]:
    """Prediction, correctness and margin of every mode in `modes` for one prompt."""
    res: dict[str, dict] = {}
    entries: dict[int, list] = {}

    def record(name, out):
        pred, margin = decode(engine, out, len(answer))
        res[name] = {"pred": pred, "ok": pred == answer, "margin": margin}

    for name in modes:
        if name == "full":
            record(name, engine.prefill_segments(segments, query, mode="full"))
        elif name == "prefix":
            engine.prefix_cache.clear()
            half = len(segments) // 2
            if half:  # the earlier request that shared the prompt's first documents
                engine.prefill_segments(segments[:half], query, mode="prefix")
            out = engine.prefill_segments(segments, query, mode="prefix")
            engine.prefix_cache.clear()
            if out.extra["reused_segments"] != half:
                raise RuntimeError(f"prefix cache reused {out.extra['reused_segments']} segments, expected {half}")
            record(name, out)
            res[name]["reused"] = half
        elif name == "additive":
            out = engine.prefill_segments(segments, query, entries=entries.get(0), mode="additive")
            entries.setdefault(0, out.extra["entries"])
            record(name, out)
        elif name.startswith("cut"):
            joined = [t for seg in segments for t in seg]
            length = 0 if name == "cut_whole" else int(name[len("cut"):])
            record(name, engine.prefill_segments(cut_segment(joined, length), query, mode="hypic",
                                                 seam=CUT_SEAM, order=order))
        elif name.startswith("hypic_w"):
            w = int(name[len("hypic_w"):])
            out = engine.prefill_segments(segments, query, entries=entries.get(w), mode="hypic", seam=w, order=order)
            entries.setdefault(w, out.extra["entries"])
            record(name, out)
        else:
            raise ValueError(f"unknown mode {name!r}")
    return res


_ENGINE = None


def _worker_init(model: str, threads: int) -> None:
    global _ENGINE
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    _ENGINE = load_engine(Path(model))


def _run_chunk(job: tuple[str, int, int, tuple[str, ...], str]) -> list[tuple[int, dict]]:
    task, a, b, modes, order = job
    out = []
    for i in range(a, b):
        segments, query, answer = prompt_ids(_ENGINE, task, i)
        res = run_prompt(_ENGINE, segments, query, answer, modes, order)
        out.append((sum(map(len, segments)) + len(query), res))
    return out


def evaluate(model: Path, n: int, tasks=T.TASKS, modes=MODES, order: str = "layer", workers: int = 1,
             threads: int = 1, progress: bool = True, chunk: int = 25) -> dict:
    """Run every prompt of every task in every mode (in `workers` processes: the numbers do not
    depend on how the prompts are split)."""
    jobs = [(t, a, min(a + chunk, n), tuple(modes), order) for t in tasks for a in range(0, n, chunk)]
    t0 = time.perf_counter()
    bar = tqdm(total=n * len(tasks), disable=not progress, mininterval=10, file=sys.stdout, ncols=100)
    results = []
    if workers <= 1:
        _worker_init(str(model), threads)
        for job in jobs:
            results.append(_run_chunk(job))
            bar.update(job[2] - job[1])
    else:
        with mp.get_context("spawn").Pool(workers, _worker_init, (str(model), threads)) as pool:
            for job, r in zip(jobs, pool.imap(_run_chunk, jobs)):
                results.append(r)
                bar.update(job[2] - job[1])
    bar.close()
    per: dict = {t: {m: [] for m in modes} for t in tasks}
    detail: dict = {t: {m: [] for m in modes} for t in tasks}
    n_tokens: dict = {t: [] for t in tasks}
    reused: list[int] = []
    for job, chunk_res in zip(jobs, results):
        task = job[0]
        for i, (ntok, res) in zip(range(job[1], job[2]), chunk_res):
            n_tokens[task].append(ntok)
            if "prefix" in res:
                reused.append(res["prefix"]["reused"])
            for m in modes:
                per[task][m].append(int(res[m]["ok"]))
                if i < DETAIL:
                    detail[task][m].append({"pred": res[m]["pred"], "margin": round(res[m]["margin"], 6)})
    acc = {t: {m: 100.0 * sum(per[t][m]) / n for m in modes} for t in tasks}
    return {
        "n_per_task": n,
        "modes": list(modes),
        "tasks": list(tasks),
        "order": order,
        "accuracy": acc,
        "delta_vs_full": {t: {m: acc[t][m] - acc[t]["full"] for m in modes} for t in tasks if "full" in modes},
        "prompt_tokens": {t: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for t, v in n_tokens.items()},
        "correct": {t: {m: "".join(map(str, per[t][m])) for m in modes} for t in tasks},
        "prefix_reused_segments": {"mean": sum(reused) / len(reused), "min": min(reused),
                                   "max": max(reused)} if reused else None,
        "detail": detail,
        "eval_s": round(time.perf_counter() - t0, 1),
    }


# -- outputs ---------------------------------------------------------------------------------------
def label(mode: str) -> str:
    if mode.startswith("cut"):
        return "one document, whole" if mode == "cut_whole" else f"cut at L={mode[len('cut'):]}"
    return f"hypic w={mode[len('hypic_w'):]}" if mode.startswith("hypic_w") else LABELS[mode]


def markdown_table(res: dict) -> str:
    modes, tasks = res["modes"], res["tasks"]
    lines = ["| task | " + " | ".join(label(m) for m in modes) + " |",
             "|---|" + "---:|" * len(modes)]
    for t in tasks:
        acc = res["accuracy"][t]
        lines.append(f"| {t} | " + " | ".join(f"{acc[m]:.1f}" for m in modes) + " |")
    lines.append("")
    lines.append("Difference to full recompute, points:")
    lines.append("")
    lines.append("| task | " + " | ".join(label(m) for m in modes if m != "full") + " |")
    lines.append("|---|" + "---:|" * (len(modes) - 1))
    for t in tasks:
        d = res["delta_vs_full"][t]
        lines.append(f"| {t} | " + " | ".join(f"{d[m]:+.1f}" for m in modes if m != "full") + " |")
    return "\n".join(lines)


def plot(res: dict, out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = list(range(len(SEAMS)))
    for i, t in enumerate(res["tasks"]):
        acc = res["accuracy"][t]
        c = f"C{i}"
        ax.plot(xs, [acc[f"hypic_w{w}"] for w in SEAMS], marker="o", color=c, label=f"{t}: hypic")
        ax.axhline(acc["full"], color=c, ls="--", lw=1, label=f"{t}: full recompute ({acc['full']:.1f})")
        ax.plot([xs[0] - 0.35], [acc["additive"]], marker="x", ms=9, color=c, ls="none",
                label=f"{t}: {LABELS['additive']} ({acc['additive']:.1f})")
    ax.set_xticks([xs[0] - 0.35] + xs, ["additive"] + [str(w) for w in SEAMS])
    ax.set_xlabel("seam window w (tokens recomputed at the start of each segment)")
    ax.set_ylabel("exact-match accuracy, %")
    ax.set_ylim(0, 102)
    ax.set_title(f"hypic-tiny-qwen35: accuracy vs seam window ({res['n_per_task']} prompts per task)")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--n", type=int, default=500, help="held-out prompts per task")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--workers", type=int, default=1, help="worker processes (results do not depend on it)")
    ap.add_argument("--order", default="layer", choices=("layer", "segment"),
                    help="hypic reuse order (both give the same numbers; layer-major is faster)")
    ap.add_argument("--tasks", nargs="+", default=list(T.TASKS), choices=T.TASKS)
    ap.add_argument("--cut", action="store_true", help="measure the cost of cutting long segments "
                    "(quality_cut.json, quality_cut.md)")
    args = ap.parse_args(argv)
    res = evaluate(args.model, args.n, tuple(args.tasks), CUT_MODES if args.cut else MODES,
                   order=args.order, workers=args.workers, threads=args.threads)
    try:
        model_rel = str(args.model.resolve().relative_to(ROOT))
    except ValueError:
        model_rel = str(args.model)
    res = {"model": model_rel, "fingerprint": load_engine(args.model).fingerprint, "eval_seed": T.EVAL_SEED,
           "docs_per_prompt": T.EVAL_DOCS, "threads": args.threads, **res}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "quality_cut" if args.cut else "quality"
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    table = markdown_table(res)
    what = "the documents joined into one, cut at L tokens" if args.cut else f"{T.EVAL_DOCS} documents"
    (args.out / f"{name}.md").write_text(
        f"# Quality: exact match, % ({res['n_per_task']} held-out prompts per task, "
        f"{what}, ~{round(sum(v['mean'] for v in res['prompt_tokens'].values()) / len(res['tasks']))} tokens)\n\n"
        f"Generated by `python -m bench.quality.eval{' --cut' if args.cut else ''}` from {name}.json; "
        f"model `{model_rel}`.\n\n{table}\n")
    if not args.cut:
        plot(res, args.out / "quality.png")
    print(table)
    print(f"\n{res['eval_s']:.0f} s -> {args.out}/{name}.json, {name}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
