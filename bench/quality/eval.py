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

With --entry-formats fp32 bf16 fp8t fp8 (written to quality_formats.json / quality_formats.md, then the
model's README re-rendered by bench.quality.readme, whose formats section reads them): full
recompute and hypic w=8 with its entries stored in each format, through the mesh's path, paired
prompt by prompt with fp32 entries (bench.quality.formats).

With --cut (written to quality_cut.json / quality_cut.md instead): the cost of cutting long
segments. The prompt's documents are joined into one long document (~450 tokens), then cached
    cut_whole   as one entry (the router's keep_whole), or
    cut{L}      cut into pieces of <= L tokens by common.engine.cut.cut_segment, the function the
                router applies, L in 64, 128, 256 (512 leaves ~450 tokens whole: cut_whole),
each with hypic's default seam window (8), against full recompute of the same tokens.

Segment entries are built once per prompt and seam width and reused: hypic w=0 and additive share
the same entries (both have no seam). Deterministic: no sampling, fixed prompts; the numbers do
not depend on --workers.

Every accuracy comes with its 95% Wilson interval. Per mode, beside exact match, the drift figures
of issue 26, computed by common.engine.drift (the functions the router's online shadow monitor
uses): on every prompt the KL(full || mode) of the next-token distributions at the query and top-1
agreement there (query_divergence against full recompute's logits), and on the first --drift-n
prompts of each task the decode agreement over DRIFT_STEPS (32) tokens: the mode decodes greedily,
full recompute is teacher-forced on those tokens (measure_drift), and the agreement is the fraction
of the 32 steps whose argmaxes are the same.

Writes quality.json (accuracies with intervals, drift figures, every prompt's correctness per mode,
and the first prompts' predictions with their logit margins, which tests/bench/test_quality_replay.py
replays), quality.md and quality.png.

    python -m bench.quality.drift_offline     # bench/quality/results/drift_offline.json

writes, for hypic w=8, OFFLINE_PER_TASK prompts of each task as token ids with their KL,
top-1 and decode agreement over OFFLINE_STEPS (16) tokens: what a system test replays through the
mesh with the shadow monitor on, to compare the online figures with the offline ones.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.plots import pyplot
from bench.quality import formats
from bench.quality import tasks as T
from common.engine.cut import cut_segment
from common.engine.drift import measure_drift, query_divergence
from common.engine.dtypes import ENTRY_FORMATS
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
DRIFT_STEPS = 32  # greedy decode steps whose agreement with full recompute is measured (issue 26)
DRIFT_N = 100  # prompts per task with the 32-step decode agreement (8 modes x 32 decode steps each)
OFFLINE_SEAM, OFFLINE_STEPS, OFFLINE_PER_TASK = 8, 16, 10  # drift_offline.json: hypic w=8, k=16
Z95 = 1.959964  # two-sided 95% normal quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n, in percent (it stays inside [0, 100] and is
    honest near 0 and 100%, where the normal approximation is not)."""
    if n == 0:
        return 0.0, 100.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at k = 0 and k = n one end is exactly 0 or 100% (the arithmetic leaves it off by an ulp)
    return (0.0 if k == 0 else 100.0 * max(0.0, centre - half)), (100.0 if k == n else 100.0 * min(1.0, centre + half))


def mean_interval(xs: list[float], z: float = Z95) -> tuple[float, float, float]:
    """Mean of xs with a normal-approximation 95% interval (per-prompt figures, e.g. the fraction
    of 32 steps that agree, are not Bernoulli: Wilson does not apply)."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return m, m - z * sd / math.sqrt(n), m + z * sd / math.sqrt(n)


def load_engine(model: Path):
    return HybridEngine.from_pretrained(model, dtype=torch.float32, device="cpu")


def encode(engine, words: list[str]) -> list[int]:
    return engine.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]


def prompt_ids(engine, task: str, index: int):
    world, q = T.eval_prompt(task, index)
    segments = [encode(engine, d) for d in world.docs]
    return segments, encode(engine, q.words), encode(engine, q.answer)


def greedy(engine, out, n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of n tokens from a PrefillOutput, with each step's top-1/top-2 logit margin."""
    tokens, margins, logits, state = [], [], out.logits, out.state
    for i in range(n):
        top = torch.topk(logits.float(), 2).values
        margins.append(float(top[0] - top[1]))
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if i < n - 1:
            logits, state = engine.decode_step(tok, state)
    return tokens, margins


def decode(engine, out, n: int) -> tuple[list[int], float]:
    """Greedy decoding of n tokens from a PrefillOutput; also the smallest top-1/top-2 logit margin
    seen (a near-tie could flip under another float summation order)."""
    tokens, margins = greedy(engine, out, n)
    return tokens, min(margins, default=float("inf"))


def run_prompt(engine, segments, query, answer, modes=MODES, order: str = "layer",
               drift_steps: int = 0) -> dict[str, dict]:
    """Prediction, correctness and margin of every mode in `modes` for one prompt; with "full"
    first in `modes`, each mode's KL and top-1 agreement with it at the query; with drift_steps,
    each mode's greedy decode of that many tokens teacher-forced through full recompute
    (measure_drift: "agreement")."""
    res: dict[str, dict] = {}
    entries: dict[int, list] = {}
    full_logits, format_logits = [], {}
    prompt = [t for seg in segments for t in seg] + list(query)

    def record(name, out):
        # one greedy decode serves both: its first len(answer) tokens are the prediction
        tokens, margins = greedy(engine, out, max(len(answer), drift_steps))
        pred = tokens[: len(answer)]
        res[name] = {"pred": pred, "ok": pred == answer, "margin": min(margins[: len(answer)])}
        if name == "full":
            full_logits.append(out.logits)
        if "@" in name:
            format_logits[name] = out.logits
        if full_logits:
            res[name]["kl"], res[name]["top1"] = query_divergence(full_logits[0], out.logits)
        if drift_steps:
            res[name]["agreement"] = measure_drift(engine, prompt, tokens, tokens, out.logits).agreement

    for name in modes:
        if name == "full":
            record(name, engine.prefill_segments(segments, query, mode="full"))
        elif "@" in name:  # hypic_w{w}@{format}
            record(name, formats.prefill_at_format(engine, segments, query, name, order))
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
    formats.pair(res, format_logits)
    return res


_ENGINE = None


def _worker_init(model: str, threads: int) -> None:
    global _ENGINE
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    _ENGINE = load_engine(Path(model))


def _run_chunk(job: tuple[str, int, int, tuple[str, ...], str, int]) -> list[tuple[int, dict]]:
    task, a, b, modes, order, drift_n = job
    out = []
    for i in range(a, b):
        segments, query, answer = prompt_ids(_ENGINE, task, i)
        res = run_prompt(_ENGINE, segments, query, answer, modes, order, DRIFT_STEPS if i < drift_n else 0)
        out.append((sum(map(len, segments)) + len(query), res))
    return out


def intervals(correct: dict) -> dict:
    """95% Wilson intervals of the accuracies from the per-prompt correctness strings ("0110...")."""
    return {t: {m: list(wilson(bits.count("1"), len(bits))) for m, bits in per_mode.items()}
            for t, per_mode in correct.items()}


def merge_drift(path: Path, model: Path, n: int, threads: int = 1) -> dict:
    """Add to a published quality.json (computed for these weights) what it lacks: the Wilson
    intervals (from its correctness strings) and the drift figures of its modes over the first n
    prompts per task (KL and top-1 at the query, DRIFT_STEPS-token decode agreement)."""
    from bench import results_json

    res = results_json.load(path)
    if res["fingerprint"] != load_engine(model).fingerprint:
        raise SystemExit(f"{path} was computed for other weights than {model}")
    res["interval95"] = intervals(res["correct"])
    drift = evaluate(model, n, tuple(res["tasks"]), tuple(res["modes"]), res.get("order", "layer"),
                     threads=threads, drift_n=n)
    for key in ("query_prompts", "query_kl", "query_top1", "decode_steps", "decode_agreement"):
        res[key] = drift[key]
    res["drift_eval_s"] = drift["eval_s"]
    return res


def drift_figures(modes, tasks, kl: dict, top1: dict, agree: dict) -> dict:
    """quality.json's drift section from per-prompt figures ({task: {mode: [...]}})."""
    def agreement(t, m):
        mean, lo, hi = mean_interval(agree[t][m])
        return {"mean": 100.0 * mean, "interval95": [100.0 * lo, 100.0 * hi], "n": len(agree[t][m]),
                "identical": 100.0 * sum(x == 1.0 for x in agree[t][m]) / max(1, len(agree[t][m]))}

    out: dict = {"decode_steps": DRIFT_STEPS}
    if any(kl[t][m] for t in tasks for m in modes):
        out["query_prompts"] = len(kl[tasks[0]][modes[0]])
        out["query_kl"] = {t: {m: sum(kl[t][m]) / len(kl[t][m]) for m in modes} for t in tasks}
        out["query_top1"] = {t: {m: {"pct": 100.0 * sum(top1[t][m]) / len(top1[t][m]),
                                     "interval95": list(wilson(sum(top1[t][m]), len(top1[t][m])))}
                                 for m in modes} for t in tasks}
    if any(agree[t][m] for t in tasks for m in modes):
        out["decode_agreement"] = {t: {m: agreement(t, m) for m in modes} for t in tasks}
    return out


def evaluate(model: Path, n: int, tasks=T.TASKS, modes=MODES, order: str = "layer", workers: int = 1,
             threads: int = 1, progress: bool = True, chunk: int = 25, drift_n: int = 0) -> dict:
    """Run every prompt of every task in every mode (in `workers` processes: the numbers do not
    depend on how the prompts are split); the first `drift_n` prompts of each task also get the
    DRIFT_STEPS-token decode agreement."""
    jobs = [(t, a, min(a + chunk, n), tuple(modes), order, drift_n) for t in tasks for a in range(0, n, chunk)]
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
    kl: dict = {t: {m: [] for m in modes} for t in tasks}
    top1: dict = {t: {m: [] for m in modes} for t in tasks}
    agree: dict = {t: {m: [] for m in modes} for t in tasks}
    reused: list[int] = []
    paired: dict = {}
    for job, chunk_res in zip(jobs, results):
        task = job[0]
        for i, (ntok, res) in zip(range(job[1], job[2]), chunk_res):
            n_tokens[task].append(ntok)
            formats.collect(paired, task, res)
            if "prefix" in res:
                reused.append(res["prefix"]["reused"])
            for m in modes:
                per[task][m].append(int(res[m]["ok"]))
                if "kl" in res[m]:
                    kl[task][m].append(res[m]["kl"])
                    top1[task][m].append(int(res[m]["top1"]))
                if "agreement" in res[m]:
                    agree[task][m].append(res[m]["agreement"])
                if i < DETAIL:
                    detail[task][m].append({"pred": res[m]["pred"], "margin": round(res[m]["margin"], 6)})
    acc = {t: {m: 100.0 * sum(per[t][m]) / n for m in modes} for t in tasks}
    return {
        "n_per_task": n,
        "modes": list(modes),
        "tasks": list(tasks),
        "order": order,
        "accuracy": acc,
        "interval95": intervals({t: {m: "".join(map(str, per[t][m])) for m in modes} for t in tasks}),
        "delta_vs_full": {t: {m: acc[t][m] - acc[t]["full"] for m in modes} for t in tasks if "full" in modes},
        "prompt_tokens": {t: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for t, v in n_tokens.items()},
        "correct": {t: {m: "".join(map(str, per[t][m])) for m in modes} for t in tasks},
        "prefix_reused_segments": {"mean": sum(reused) / len(reused), "min": min(reused),
                                   "max": max(reused)} if reused else None,
        "detail": detail,
        **drift_figures(modes, tasks, kl, top1, agree),
        **formats.paired_figures(paired, wilson),
        "eval_s": round(time.perf_counter() - t0, 1),
    }


# -- outputs ---------------------------------------------------------------------------------------
def label(mode: str) -> str:
    if "@" in mode:
        return formats.label(mode)
    if mode.startswith("cut"):
        return "one document, whole" if mode == "cut_whole" else f"cut at L={mode[len('cut'):]}"
    return f"hypic w={mode[len('hypic_w'):]}" if mode.startswith("hypic_w") else LABELS[mode]


def _cell(pct: float, interval) -> str:
    return f"{pct:.1f}" if interval is None else f"{pct:.1f} [{interval[0]:.1f}, {interval[1]:.1f}]"


def markdown_table(res: dict) -> str:
    """Accuracy (with its 95% Wilson interval where the results have one), the difference to full
    recompute, and the drift figures where the results have them."""
    modes, tasks = res["modes"], res["tasks"]
    lines = ["| task | " + " | ".join(label(m) for m in modes) + " |",
             "|---|" + "---:|" * len(modes)]
    for t in tasks:
        acc, ci = res["accuracy"][t], res.get("interval95", {}).get(t, {})
        lines.append(f"| {t} | " + " | ".join(_cell(acc[m], ci.get(m)) for m in modes) + " |")
    lines.append("")
    if "interval95" in res:
        lines += ["Exact match, % [95% Wilson interval].", ""]
    lines.append("Difference to full recompute, points:")
    lines.append("")
    lines.append("| task | " + " | ".join(label(m) for m in modes if m != "full") + " |")
    lines.append("|---|" + "---:|" * (len(modes) - 1))
    for t in tasks:
        d = res["delta_vs_full"][t]
        lines.append(f"| {t} | " + " | ".join(f"{d[m]:+.1f}" for m in modes if m != "full") + " |")
    return "\n".join(lines + drift_tables(res) + formats.paired_table(res))


def drift_tables(res: dict) -> list[str]:
    """The drift figures (common.engine.drift) per task and mode, where the results have them."""
    modes, tasks, lines = res["modes"], res["tasks"], []
    head = ["| task | " + " | ".join(label(m) for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    if "query_kl" in res:
        lines += ["", f"KL(full recompute || mode) of the next-token distributions at the query, nats (mean over "
                  f"{res.get('query_prompts', res['n_per_task'])} prompts per task):", "", *head]
        lines += [f"| {t} | " + " | ".join(f"{res['query_kl'][t][m]:.4f}" for m in modes) + " |" for t in tasks]
        lines += ["", "Top-1 agreement with full recompute at the query, % [95% Wilson interval]:", "", *head]
        lines += [f"| {t} | " + " | ".join(_cell(res["query_top1"][t][m]["pct"], res["query_top1"][t][m]["interval95"])
                                          for m in modes) + " |" for t in tasks]
    if "decode_agreement" in res:
        agree = res["decode_agreement"]
        n = agree[tasks[0]][modes[0]]["n"]
        lines += ["", f"Decode agreement over {res['decode_steps']} tokens, % [95% interval]: the mode decodes "
                  f"greedily, full recompute is teacher-forced on its tokens, and each step counts when the two "
                  f"argmaxes agree (mean over the first {n} prompts per task; in parentheses the share of prompts "
                  f"whose {res['decode_steps']} steps all agree):", "", *head]
        lines += [f"| {t} | " + " | ".join(f"{_cell(agree[t][m]['mean'], agree[t][m]['interval95'])} "
                                          f"({agree[t][m]['identical']:.0f})" for m in modes) + " |" for t in tasks]
    return lines


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
    ap.add_argument("--modes", nargs="+", default=None, choices=MODES,
                    help="a subset of the modes (quick checks; the published table has them all)")
    ap.add_argument("--cut", action="store_true", help="measure the cost of cutting long segments "
                    "(quality_cut.json, quality_cut.md)")
    ap.add_argument("--entry-formats", nargs="+", default=None, choices=ENTRY_FORMATS,
                    help="full recompute and hypic w=8 with entries stored in each format, paired with fp32 "
                    "(quality_formats.json, quality_formats.md)")
    ap.add_argument("--drift-n", type=int, default=DRIFT_N,
                    help=f"prompts per task with the {DRIFT_STEPS}-token decode agreement (0: none)")
    ap.add_argument("--merge-drift", type=int, default=0, metavar="N",
                    help="add to the published quality.json (same weights) its Wilson intervals and the drift "
                    "figures over its first N prompts per task, without re-running its accuracies")
    args = ap.parse_args(argv)
    fmts = args.entry_formats and [formats.REFERENCE] + [f for f in args.entry_formats if f != formats.REFERENCE]
    modes = CUT_MODES if args.cut else ("full", *map(formats.format_mode, fmts)) if fmts else tuple(args.modes or MODES)
    if "full" in modes:  # first: the other modes' KL and top-1 agreement are against its logits
        modes = ("full",) + tuple(m for m in modes if m != "full")
    if args.merge_drift:
        res = merge_drift(args.out / "quality.json", args.model, args.merge_drift, args.threads)
        write_results(res, args.out, "quality", "--merge-drift " + str(args.merge_drift))
        return 0
    res = evaluate(args.model, args.n, tuple(args.tasks), modes,
                   order=args.order, workers=args.workers, threads=args.threads,
                   drift_n=0 if args.cut or fmts else min(args.drift_n, args.n))
    try:
        model_rel = str(args.model.resolve().relative_to(ROOT))
    except ValueError:
        model_rel = str(args.model)
    res = {"model": model_rel, "fingerprint": load_engine(args.model).fingerprint, "eval_seed": T.EVAL_SEED,
           "docs_per_prompt": T.EVAL_DOCS, "threads": args.threads, **res}
    name, flags = ("quality_cut", "--cut") if args.cut else ("quality_formats", "--entry-formats " + " ".join(fmts)) \
        if fmts else ("quality", "")
    if args.n != ap.get_default("n"):  # the command in the .md must give the same prompts
        flags = f"{flags} --n {args.n}".strip()
    write_results(res, args.out, name, flags)
    if fmts and args.out.resolve() == DEFAULT_OUT.resolve():  # the published results: the README's source
        write_model_readme(args.model, args.out)
    return 0


def write_model_readme(model: Path, out: Path) -> None:
    """Re-render the model's README (its "Entry storage formats" section reads quality_formats.json)
    so that one --entry-formats run regenerates everything it feeds. A subprocess, not an import:
    bench.quality.readme imports this module."""
    if (model / "training_log.json").exists():  # a bundled, trained model: the one with a README
        subprocess.run([sys.executable, "-m", "bench.quality.readme", "--model", str(model), "--results", str(out)],
                       check=True, cwd=ROOT)


def write_results(res: dict, out: Path, name: str, flags: str) -> None:
    """{name}.json, {name}.md (and quality.png when every mode was run) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    cut = name == "quality_cut"
    model_rel = res["model"]
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    table = markdown_table(res)
    what = "the documents joined into one, cut at L tokens" if cut else f"{T.EVAL_DOCS} documents"
    (out / f"{name}.md").write_text(
        f"# Quality: exact match, % ({res['n_per_task']} held-out prompts per task, "
        f"{what}, ~{round(sum(v['mean'] for v in res['prompt_tokens'].values()) / len(res['tasks']))} tokens)\n\n"
        f"Generated by `python -m bench.quality.eval{' ' + flags if flags and 'merge' not in flags else ''}`"
        f"{f', then `python -m bench.quality.eval {flags}`,' if 'merge' in flags else ''} from {name}.json; "
        f"model `{model_rel}`.\n\n{table}\n")
    if not cut and set(MODES) <= set(res["modes"]):
        plot(res, out / "quality.png")
    print(table)
    print(f"\n{res['eval_s']:.0f} s -> {out}/{name}.json, {name}.md")


if __name__ == "__main__":
    raise SystemExit(main())
