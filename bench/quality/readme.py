"""Write models/hypic-tiny-qwen35/README.md from the training log and the eval JSON.

    python -m bench.quality.readme [--model models/hypic-tiny-qwen35] [--results bench/quality/results]
    python -m bench.quality.readme --check     # exit 1 when the committed files differ

Also writes the model's `hypic_model.json` (hypic/model_card.py): the one line `hypic up` and the
front's /v1/models show, saying what the model is for and how to serve a real checkpoint.
Every number in the README comes from `training_log.json` (written by bench.quality.train) and
`quality.json` (written by bench.quality.eval); nothing is typed by hand. tests/bench/test_quality_replay.py
checks that the committed README equals what this script renders.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from bench import results_json
from bench.quality import eval as E
from bench.quality import tasks as T
from hypic.model_card import CARD_FILE

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def _pct(x: float) -> str:
    return f"{x:.1f}%"


def _rel(x: float, ref: float) -> str:
    return f"{100.0 * (x - ref) / ref:+.1f}%" if ref else "n/a"


def _majority(task: str, n: int) -> float:
    """Accuracy of always giving the most frequent answer of the evaluation prompts."""
    c = Counter(tuple(T.eval_prompt(task, i)[1].answer) for i in range(n))
    return 100.0 * c.most_common(1)[0][1] / n


def _shortfalls(q: dict) -> list[str]:
    acc, d = q["accuracy"], q["delta_vs_full"]
    out = []
    for t in q["tasks"]:
        if acc[t]["full"] < 70.0:
            out.append(
                f"- **{t} falls short**: full recompute reaches {_pct(acc[t]['full'])} (target >= 70%); always "
                f"giving the most frequent answer would score {_pct(_majority(t, q['n_per_task']))}. The model did "
                "not learn this task within the training budget, so its row says nothing about caching.")
    additive = d["retrieval"]["additive"]
    if additive > -10.0:
        upd = ""
        if "update" in acc:
            upd = (f" The update task is the one that depends on the order: there additive PIC scores "
                   f"{_pct(acc['update']['additive'])} against {_pct(acc['update']['full'])} for full recompute "
                   f"({_rel(acc['update']['additive'], acc['update']['full'])} of the score) and hypic w=8 "
                   f"{_pct(acc['update']['hypic_w8'])}: without T the earlier documents' values of a restated "
                   "key are never erased from the delta-rule memory (nor decayed), so the sum of the "
                   "per-document memories holds every value the key ever had.")
        out.append(
            f"- **additive PIC loses little on retrieval, two_hop and aggregation** (retrieval {additive:+.1f} points, "
            f"two_hop {d['two_hop']['additive']:+.1f}; the seed reports -66.9% on real tasks): those tasks' facts are "
            "local to a document and each key is stated once, so the per-document delta-rule memories of "
            "disjoint keys add up almost losslessly without T (without T the earlier documents' memories are "
            "not decayed either, which can even help recall), and the cached attention keys need no context "
            "from other documents." + upd)
    return out + [""] if out else []


def _stage_lines(log: dict) -> list[str]:
    """One block per training stage (logs written before stages existed are one stage)."""
    stages = log.get("stages") or [log]
    out = []
    for i, st in enumerate(stages, 1):
        mix = st.get("mix")
        train_tasks = ", ".join(t for t, w in T.TRAIN_MIX.items() if w > 0)
        level = st.get("level")
        cur = T.Curriculum()
        own = (tuple(st["docs"]), tuple(st["filler"])) if st.get("docs") else None
        where = (f"at a level of its own ({_docs(own)} documents of {_docs(own, 1)} filler words: many short "
                 "documents, so many boundaries per prompt)" if own else
                 f"at the evaluation's level (curriculum level {level})" if level == len(cur.levels) - 1 else
                 f"at curriculum level {level} ({_docs(cur.levels[level])} documents of "
                 f"{_docs(cur.levels[level], 1)} filler words, shorter than the evaluation's)" if level is not None
                 else "with the curriculum")
        what = (f"from scratch with the curriculum below ({train_tasks})" if not st.get("init") else
                f"from stage {i - 1}'s weights (fresh optimiser, warm-up then cosine decay), {where}, task mix "
                + ", ".join(f"{t} {w:g}" for t, w in (mix or {}).items()))
        out += [
            f"Stage {i}: {what}.",
            "",
            "```",
            st["command"],
            "```",
            "",
            f"- {st['steps']} steps of batch {st['batch']}, {st['tokens'] / 1e6:.1f}M tokens, "
            f"{st['wall_s'] / 60:.1f} min of training on {st['threads']} CPU thread(s) (wall time of the "
            f"optimisation steps; the machine was shared with other jobs), seed {st['seed']}, peak lr {st['lr']:g}",
            "",
        ]
    return out


def _docs(level: tuple, which: int = 0) -> str:
    lo, hi = level[which]
    return f"{lo}-{hi}"


# The architectures a real checkpoint may have (README's "Supported models", docs/models.md).
ARCHITECTURES = ("Qwen3.5, Qwen3-Next, Kimi-Linear, Ring/Ling 2.5, MiniMax-Text-01, OLMo hybrid, "
                 "Nemotron-H, Bamba, Granite 4, Falcon-H1, Jamba, Zamba2")


def model_card(model_dir: Path, results_dir: Path) -> dict:
    """hypic_model.json: what a user is told about the model wherever they meet it."""
    log = json.loads((model_dir / "training_log.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    q = results_json.load(results_dir / "quality.json")
    longest = max(v["max"] for v in q["prompt_tokens"].values())
    return {
        "description": (
            f"a {log['n_params'] / 1e6:.2f}M-parameter demo model with a {cfg['vocab_size']}-word "
            "synthetic vocabulary, trained only to answer find/chain/count questions about short "
            f"synthetic documents ({q['docs_per_prompt']} per prompt; its evaluation prompts are "
            f"at most {longest} tokens); it cannot answer real text. Serve a real checkpoint with `hypic up --model DIR` (a Hugging "
            f"Face directory of {ARCHITECTURES})"),
        "trained_prompt_tokens": longest,
    }


def render(model_dir: Path, results_dir: Path) -> str:
    log = json.loads((model_dir / "training_log.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    q = results_json.load(results_dir / "quality.json")
    card = model_card(model_dir, results_dir)
    formats = results_dir / "quality_formats.json"
    return "\n".join(_model_lines(cfg, log, card) + _training_lines(log) + _quality_lines(q, log)
                     + (_format_lines(results_json.load(formats)) if formats.exists() else []))


def _format_lines(f: dict) -> list[str]:
    """The entry storage formats' section (bench/quality/results/quality_formats.json)."""
    ref, paired, n = f["reference_format"], f["paired"], f["n_per_task"]
    modes = [m for m in f["modes"] if any(m in per for per in paired.values())]

    def summary(m: str) -> str:
        figs = [per[m] for per in paired.values()]
        worst = max(abs(x["delta_pts"]) for x in figs)
        return (f"{E.label(m)}: {sum(x['differ'] for x in figs)} of {sum(x['n'] for x in figs)} answers differ from "
                f"{ref} entries', the largest accuracy difference on a task is {worst:.1f} points, and the largest "
                f"KL({ref} entries || format) at the query {max(x['kl_vs_reference_max'] for x in figs):.1e} nats")

    return [
        "## Entry storage formats",
        "",
        f"The same {n} held-out prompts per task through the mesh's path with hypic w=8's entries stored in each "
        "format (`python -m bench.quality.eval --entry-formats`: built at the format, to bytes and back, the "
        f"combine's check, composed), paired prompt by prompt with {ref} entries.",
        "",
        E.markdown_table(f),
        "",
        *[f"- {summary(m)}." for m in modes],
        "",
    ]


def _model_lines(cfg: dict, log: dict, card: dict) -> list[str]:
    kinds = ["L" if t == "linear_attention" else "F" for t in cfg["layer_types"]]
    return [
        "# hypic-tiny-qwen35",
        "",
        f"**A toy, not a language model:** {card['description']}.",
        "",
        "A tiny Qwen3.5-architecture hybrid (Gated DeltaNet + gated full attention) trained from scratch",
        "on CPU on the synthetic tasks of `bench/quality/tasks.py`. It is the bundled default model of",
        "`make demo` and the mesh, and the model of the quality evaluation (`bench/quality/eval.py`):",
        "pretrained weights cannot be downloaded where Hypic is built, so quality is measured on a model",
        "whose answers must come from the prompt's segments.",
        "",
        "Generated by `python -m bench.quality.readme` from `training_log.json` and",
        "`bench/quality/results/quality.json`; not edited by hand.",
        "",
        "## Model",
        "",
        f"- `model_type` `{cfg['model_type']}` (transformers' `Qwen3_5ForCausalLM`, saved with `save_pretrained`)",
        f"- layers `[{', '.join(kinds)}]` (L = Gated DeltaNet, F = gated full attention), dense MLP",
        f"- hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}, attention {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} kv heads of dim {cfg['head_dim']}, linear heads {cfg['linear_num_key_heads']} key / "
        f"{cfg['linear_num_value_heads']} value of dim {cfg['linear_key_head_dim']}, conv kernel {cfg['linear_conv_kernel_dim']}",
        f"- {log['n_params']:,} parameters, vocabulary {cfg['vocab_size']} (WordLevel `tokenizer.json`, trained with",
        "  `tokenizers` on the generator's language; `AutoTokenizer.from_pretrained` loads it)",
        "",
    ]


def _training_lines(log: dict) -> list[str]:
    cur = T.Curriculum()
    last = log["evals"][-1] if log["evals"] else {}
    lines = [
        "## Training",
        "",
        f"{log['steps']} steps in all, {log['tokens'] / 1e6:.1f}M tokens, {log['wall_s'] / 60:.1f} min of training.",
        "",
        *_stage_lines(log),
        "Common to the stages:",
        "",
        "- Mamba2-style init of the Gated DeltaNet decay gates (dt log-uniform in [1e-3, 1e-1],",
        "  dt_bias = dt + log(-expm1(-dt)), A ~ U(0, 16), A_log = log A); AdamW, betas (0.9, 0.98),",
        "  weight decay 0.01 (none on norms, A_log, dt_bias), warm-up then cosine decay; gradient clipping 1.0",
        "- dense supervision: every training prompt carries 24-32 queries after its documents, with the",
        "  loss on every answer token; stage 1's curriculum over the number of documents and filler words",
        f"  (first {_docs(cur.levels[0])} documents of a few facts and retrieval queries only, then the other "
        f"tasks too, up to {_docs(cur.levels[-1])}",
        f"  documents of {_docs(cur.levels[-1], 1)} filler words; up a level once the retrieval answers are "
        f"right, forced up from {cur.force_from:.0%}",
        f"  of the steps so that the evaluation's level is reached by {cur.force_by:.0%}); with update "
        "queries in the mix,",
        "  2-6 keys per prompt are restated in later documents and every `find` answers the last value",
        *(["- with span queries in the mix, 2-7 document boundaries per prompt carry a fact split over them",
           f"  (the key ends one document, the next opens `<doc> {' '.join(T.SPAN_OPENING)} VALUE .`), every other "
           "boundary opens the same way with no key before it",
           "  (a decoy), and no query is repeated: otherwise the span answers are the only values opening",
           "  documents and can be found by elimination instead of by pairing"]
          if any((st.get("mix") or {}).get("span", 0) > 0 for st in log.get("stages") or []) else []),
        "- resumable: a checkpoint every 50 steps under `--work`; `--resume` continues exactly (the batch",
        "  of step s is generated from (seed, s))",
        "",
        "![loss curve](loss_curve.png)",
        "",
    ]
    if last:
        lines += [
            f"Quick held-out check at the last step (transformers' forward, 40 prompts per task): "
            + ", ".join(f"{t} {100 * last[t]:.1f}%" for t in T.TASKS if t in last) + ".",
            "",
        ]
    return lines


def _span_lines(q: dict) -> list[str]:
    """The span task's line and what its seam columns show (nothing for results without it)."""
    if "span" not in q["tasks"]:
        return []
    acc, ci = q["accuracy"]["span"], q.get("interval95", {}).get("span", {})

    def at(m):
        return f"{acc[m]:.1f}%" + (f" [{ci[m][0]:.1f}, {ci[m][1]:.1f}]" if m in ci else "")

    return [
        "- span: `<q> find KEY <a>` -> the value of a fact split over a document boundary: the key ends one",
        f"  document and the value opens the next (`... KEY` | `<doc> {' '.join(T.SPAN_OPENING)} VALUE . ...`), "
        "at 4-7 of the 7",
        "  boundaries, the value 4 tokens after the key (beyond the short convolution's reach, and past the",
        "  3 opening tokens hypic always recomputes for it); only a model that reads a document's opening",
        "  in the context of the previous one",
        f"  pairs them. Here the seam matters: hypic w=0 scores {at('hypic_w0')}, w=2 {at('hypic_w2')}, "
        f"w=8 {at('hypic_w8')}, full recompute {at('full')} (95% Wilson intervals)",
    ]


def _quality_lines(q: dict, log: dict) -> list[str]:
    acc, d = q["accuracy"], q["delta_vs_full"]
    toks = {t: round(v["mean"]) for t, v in q["prompt_tokens"].items()}
    lines: list[str] = []
    lines += [
        "## Quality (exact match through `HybridEngine.prefill_segments` and greedy decoding)",
        "",
        f"{q['n_per_task']} held-out prompts per task, {q['docs_per_prompt']} documents (one segment each) + one "
        f"query, {', '.join(f'{t} ~{n}' for t, n in toks.items())} tokens.",
        "",
        E.markdown_table(q),
        "",
        "- retrieval: `<q> find KEY <a>` -> the value stated for KEY in one of the documents",
        "- two_hop: `<q> chain K1 <a>` -> `K2 V`: K1's value is the key K2, whose value V is stated in",
        "  another document; both decoded tokens must be right",
        "- aggregation: `<q> count NAME <a>` -> how many documents (0-4) mention NAME",
        *([f"- prefix cache: an earlier request with the first {q['docs_per_prompt'] // 2} documents left "
           "their segment-aligned states in the cache; the measured request reuses them "
           f"({q['prefix_reused_segments']['min']}-{q['prefix_reused_segments']['max']} segments) and computes "
           "the rest (exact by construction)"] if q.get("prefix_reused_segments") else []),
        "- update: `<q> find KEY <a>` -> the value of KEY's last statement: 1-3 keys of the prompt are",
        "  restated with new values in 1-2 later documents, and one of them is asked (documents are read in",
        "  order; later ones revise earlier ones, as in a log or a versioned record)",
        *_span_lines(q),
        "",
        f"Acceptance: full recompute on retrieval {_pct(acc['retrieval']['full'])} (target >= 90%); "
        f"hypic w=8 vs full on retrieval {d['retrieval']['hypic_w8']:+.1f} points (target within 1.0); "
        f"additive PIC on retrieval {d['retrieval']['additive']:+.1f} points "
        f"({_rel(acc['retrieval']['additive'], acc['retrieval']['full'])} of the score; the seed reports -66.9%)"
        + (f", on update {d['update']['additive']:+.1f} points ({_rel(acc['update']['additive'], acc['update']['full'])}; "
           f"hypic w=8 {d['update']['hypic_w8']:+.1f} points)" if "update" in acc else "") + ".",
        "",
        *_shortfalls(q),
        "![accuracy vs seam window](../../bench/quality/results/quality.png)",
        "",
        "## Reproduce",
        "",
        "```",
        *[st["command"] + f"   # stage {i}: writes this directory"
          for i, st in enumerate(log.get("stages") or [log], 1)],
        "python -m bench.quality.eval      # bench/quality/results/quality.{json,md,png}",
        "python -m bench.quality.readme    # this README",
        "```",
        "",
    ]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=E.DEFAULT_MODEL)
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when README.md or hypic_model.json differ")
    args = ap.parse_args(argv)
    files = {args.model / "README.md": render(args.model, args.results),
             args.model / CARD_FILE: json.dumps(model_card(args.model, args.results), indent=2) + "\n"}
    if args.check:
        stale = [str(p) for p, text in files.items()
                 if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p} is not what `python -m bench.quality.readme` renders")
        return 1 if stale else 0
    for p, text in files.items():
        p.write_text(text)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
