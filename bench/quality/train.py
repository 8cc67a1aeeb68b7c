"""Train the bundled tiny Qwen3.5-architecture hybrid on the quality tasks, from scratch, on CPU.

    nice -n 5 .venv/bin/python -m bench.quality.train --steps 1200 --max-minutes 58 --work /tmp/hypic-train [--resume]

transformers' own `Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention, layers [L, F, L, F],
dense MLP) with the Mamba2-style gate initialisation that makes it learn here (see
ENVIRONMENT.md): dt log-uniform in [1e-3, 1e-1], dt_bias = dt + log(-expm1(-dt)), A ~ U(0, 16),
A_log = log(A). Dense supervision (24-32 queries per prompt, loss on every answer token), a
curriculum over the number of documents and the filler (tasks.Curriculum: up a level once the
retrieval answers of the current one are right, forced up from 60% of the steps so that the
evaluation's level is reached by 85%), AdamW, warm-up then cosine decay. The batch of step s is
generated from (seed, s, level), so a run resumed from a checkpoint (every --ckpt-every steps under
--work; the curriculum state is in it) continues exactly.

Associative recall is learned in a jump: ~250-300 steps of batch 16 at chance-like accuracy
(the model only learns to output some value present in the prompt), then within a few dozen
steps most answers are right. The curriculum therefore waits at the easiest level, with
retrieval queries only, for it; the other two tasks join from level 1.

At the end it writes a Hugging Face checkpoint (save_pretrained) with the tokenizer, the loss
curve and the training log to --out (models/hypic-tiny-qwen35 by default).

Stages: `--init DIR` starts from a checkpoint this script wrote (its weights and tokenizer, a fresh
optimiser and learning-rate schedule) and appends a stage to its training log, so that the log,
the loss curve and the README show the whole history. The bundled model is stage 1 (the
curriculum's tasks from scratch) followed by stage 2 (the update task added, at the evaluation's
level).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from bench.plots import pyplot
from bench.quality import tasks as T

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "models" / "hypic-tiny-qwen35"

MODEL_CONFIG = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, initializer_range=0.02,
)


def build_model(vocab_size: int, special: dict[str, int], seed: int):
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(vocab_size=vocab_size, pad_token_id=special["<pad>"], eos_token_id=special["<eos>"],
                            bos_token_id=special["<doc>"], **MODEL_CONFIG)
    model = Qwen3_5ForCausalLM(cfg).float()
    gate_init(model, seed)
    return model


@torch.no_grad()
def gate_init(model, seed: int) -> None:
    """Mamba2-style init of every Gated DeltaNet's decay gate (transformers' default leaves the
    per-token decay near zero in most heads, and the model never learns to retrieve)."""
    g = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, Qwen3_5GatedDeltaNet):
            n = m.dt_bias.numel()
            dt = torch.exp(torch.rand(n, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            A = torch.rand(n, generator=g) * 16
            m.A_log.copy_(torch.log(A.clamp_min(1e-4)))


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if ("norm" in name or name.endswith("A_log") or name.endswith("dt_bias")) else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, base: float, warmup: int = 40, floor: float = 0.1) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_batch(seed: int, step: int, batch: int, level: int, ids: dict[str, int], cur: T.Curriculum,
               mix: dict[str, float] = T.TRAIN_MIX):
    """Padded input ids [B, L], answer positions, answer ids and task indices of step `step`."""
    rng = random.Random(seed * 1_000_003 + step)
    seqs, pos, ans, task = [], [], [], []
    for b in range(batch):
        n_docs, filler = cur.sample(rng, level)
        words, targets = T.train_sequence(rng, n_docs, filler, mix=mix)
        seqs.append([ids[w] for w in words])
        for p, a, t in targets:
            pos.append((b, p))
            ans.append(ids[a])
            task.append(T.TASKS.index(t))
    L = max(len(s) for s in seqs)
    x = torch.full((batch, L), ids["<pad>"], dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, : len(s)] = torch.tensor(s)
    pos_t = torch.tensor(pos, dtype=torch.long)
    return x, pos_t, torch.tensor(ans), torch.tensor(task), sum(len(s) for s in seqs)


def answer_logits(model, x, pos):
    h = model.model(input_ids=x, use_cache=False).last_hidden_state
    return model.lm_head(h[pos[:, 0], pos[:, 1]])


@torch.no_grad()
def heldout_accuracy(model, ids: dict[str, int], n: int = 40, seed: int = 99_000_017) -> dict[str, float]:
    """Accuracy on n prompts per task (8 documents, one query, the eval format) with
    transformers' forward: a quick look during training, not the published eval."""
    model.eval()
    dev = next(model.parameters()).device
    acc = {}
    for task in T.TASKS:
        correct = 0
        for i in range(n):
            world, q = T.eval_prompt(task, i, seed=seed)
            # teacher-forced over the answer tokens: all right <=> greedy decoding gives the answer
            s = [ids[w] for d in world.docs for w in d] + [ids[w] for w in q.words + q.answer[:-1]]
            h = model.model(input_ids=torch.tensor([s], device=dev), use_cache=False).last_hidden_state[0]
            pred = model.lm_head(h[-len(q.answer):]).argmax(-1).tolist()
            correct += int(pred == [ids[w] for w in q.answer])
        acc[task] = correct / n
    model.train()
    return acc


def save_checkpoint(path: Path, model, opt, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, path)


def plot_curve(history: list[dict], evals: list[dict], out: Path, stage_steps: list[int] = ()) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    loss = [h["loss"] for h in history]
    ema, sm = [], None
    for v in loss:
        sm = v if sm is None else 0.95 * sm + 0.05 * v
        ema.append(sm)
    ax[0].plot(steps, loss, color="0.8", lw=0.8, label="loss (per step)")
    ax[0].plot(steps, ema, color="C0", lw=1.5, label="loss (EMA)")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy on answer tokens")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[0].set_title("training loss")
    for i, task in enumerate(T.TASKS):
        pts = [(e["step"], 100 * e[task]) for e in evals if task in e]
        if pts:
            ax[1].plot(*zip(*pts), marker="o", ms=3, label=task)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("held-out accuracy, % (8 docs, quick check)")
    ax[1].set_ylim(0, 100)
    ax[1].legend()
    ax[1].set_title("held-out accuracy during training")
    edge = 0
    for n in list(stage_steps)[:-1]:  # where a stage ends and the next begins
        edge += n
        for a in ax:
            a.axvline(edge, color="0.5", ls=":", lw=1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def prior_stages(init: Path | None) -> dict:
    """Stages, history and evals of the checkpoint `--init` starts from (empty for a run from scratch).
    A log written before stages existed is one stage."""
    if init is None:
        return {"stages": [], "history": [], "evals": []}
    log = json.loads((init / "training_log.json").read_text())
    stages = log.get("stages") or [{k: log[k] for k in ("command", "seed", "steps", "batch", "lr", "wall_s", "tokens",
                                                          "threads")}]
    return {"stages": stages, "history": log["history"], "evals": log["evals"]}


def export(model, tokenizer, out: Path, state: dict, args, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    n_params = sum(p.numel() for p in model.parameters())
    stage = {"command": command, "seed": args.seed, "steps": state["step"], "batch": args.batch, "lr": args.lr,
             "wall_s": state["wall_s"], "tokens": state["tokens"], "threads": args.threads,
             "init": str(args.init) if args.init else None, "mix": state.get("mix"), "level": args.level,
             "start_level": args.start_level, "promote_task": args.promote_task, "docs": args.docs,
             "filler": args.filler}
    stages = state["prior"]["stages"] + [stage]
    history = state["prior"]["history"] + state["history"]
    evals = state["prior"]["evals"] + state["evals"]
    log = {
        "command": " && ".join(s["command"] for s in stages),
        "seed": args.seed,
        "steps": sum(s["steps"] for s in stages),
        "batch": args.batch,
        "lr": args.lr,
        "wall_s": sum(s["wall_s"] for s in stages),
        "tokens": sum(s["tokens"] for s in stages),
        "n_params": n_params,
        "threads": args.threads,
        "stages": stages,
        "history": history,
        "evals": evals,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_curve(history, evals, out / "loss_curve.png", [s["steps"] for s in stages])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="1 by default: on a shared 2-core machine 2 threads (OpenMP spinning) ran 5-20x slower")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hypic-train"))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--resume", action="store_true", help="continue from --work/ckpt.pt")
    ap.add_argument("--init", type=Path, default=None,
                    help="start a new stage from this checkpoint (written by this script) instead of from scratch")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--mix", nargs="*", help="task weights, e.g. retrieval=1 two_hop=0 (experiments)")
    ap.add_argument("--level", type=int, default=None, help="fix the curriculum level (experiments)")
    ap.add_argument("--promote-at", type=float, default=0.85,
                    help="curriculum: next level once the --promote-task accuracy (EMA) reaches this")
    ap.add_argument("--promote-task", default="retrieval", choices=T.TASKS,
                    help="curriculum: the task whose answers decide when to move up a level")
    ap.add_argument("--start-level", type=int, default=0, help="curriculum: the level to start from")
    ap.add_argument("--docs", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                    help="train at one level of LO..HI documents instead of the curriculum's (with --filler)")
    ap.add_argument("--filler", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                    help="filler words per document at that level (with --docs)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="stop (and export) after this much training time")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop (and export) after this many steps; the learning-rate schedule still spans --steps "
                    "(a run stopped early on purpose, reproducibly, unlike --max-minutes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if (args.docs is None) != (args.filler is None):
        ap.error("--docs and --filler go together")
    if args.init and not (args.init / "tokenizer.json").exists():  # never write into a stage's checkpoint
        ap.error(f"--init {args.init}: no tokenizer.json there (not a checkpoint this script wrote)")
    return args


def load_model(args, tokenizer, ids: dict[str, int]):
    """The model a stage starts from: --init's checkpoint, or a fresh one."""
    if args.init:
        return Qwen3_5ForCausalLM.from_pretrained(str(args.init), dtype=torch.float32)
    return build_model(len(tokenizer), {w: ids[w] for w in T.SPECIALS}, args.seed)


def curriculum(args) -> T.Curriculum:
    """The curriculum's levels, or with --docs/--filler one level of their own (the span task's
    boundary-dense prompts: many short documents, so many boundaries per training sequence)."""
    if args.docs is None:
        return T.Curriculum()
    return T.Curriculum(levels=((tuple(args.docs), tuple(args.filler)),), mixes=())


def task_mix(args) -> dict[str, float] | None:
    """--mix's task weights for every level, or None: the curriculum's."""
    if not args.mix:
        return None
    mix = {t: 0.0 for t in T.TASKS}
    for item in args.mix:
        task, w = item.split("=")
        mix[task] = float(w)
    return mix


def train_step(model, opt, args, state: dict, cur: T.Curriculum, ids: dict[str, int], dev, offset: int):
    """One optimizer step at the curriculum's level; updates `state` (history, level). Returns
    (loss, accuracy per task of this batch's answers)."""
    step = state["step"]
    mix = state["mix"]
    t0 = time.perf_counter()
    level = cur.level(state["level"], step / args.steps) if args.level is None else args.level
    if level != state["level"]:
        state["level"], state["level_steps"], state["acc_ema"] = level, 0, 0.0
        print(f"\n[curriculum] step {step}: level {level} {cur.levels[level]}", flush=True)
    x, pos, ans, task, ntok = make_batch(args.seed, step, args.batch, level, ids, cur, mix or cur.mix(level))
    x, pos, ans = x.to(dev), pos.to(dev), ans.to(dev)
    for grp in opt.param_groups:
        grp["lr"] = lr_at(step, args.steps, args.lr)
    logits = answer_logits(model, x, pos)
    loss = F.cross_entropy(logits.float(), ans)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    hit = (logits.argmax(-1) == ans).cpu()
    per_task = {t: float(hit[task == i].float().mean()) if (task == i).any() else None
                for i, t in enumerate(T.TASKS)}
    state["wall_s"] += time.perf_counter() - t0
    state["tokens"] += ntok
    state["step"] = step + 1
    state["history"].append({"step": offset + step + 1, "loss": float(loss.detach()), "wall_s": round(state["wall_s"], 2),
                             "gnorm": float(gnorm), **{f"acc_{t}": a for t, a in per_task.items()}})
    # move up a level once the promotion task is answered at this one (EMA of the per-token accuracy)
    if per_task[args.promote_task] is not None:
        state["acc_ema"] = 0.9 * state["acc_ema"] + 0.1 * per_task[args.promote_task]
    state["level_steps"] += 1
    if (state["acc_ema"] >= args.promote_at and state["level_steps"] >= 20
            and state["level"] < len(cur.levels) - 1):
        state["level"], state["level_steps"], state["acc_ema"] = state["level"] + 1, 0, 0.0
        print(f"\n[curriculum] step {step + 1}: level {state['level']} {cur.levels[state['level']]}", flush=True)
    state["history"][-1]["level"] = level
    return float(loss.detach()), per_task


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    args.work.mkdir(parents=True, exist_ok=True)
    tok_dir = args.init if args.init else args.work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        T.train_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = T.word_ids(tokenizer)
    model = load_model(args, tokenizer, ids)
    prior = prior_stages(args.init)  # read now: --out may be --init and is overwritten at the end
    n_params = sum(p.numel() for p in model.parameters())
    dev = torch.device(args.device)
    model.to(dev).train()
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.98))
    state = {"step": 0, "wall_s": 0.0, "tokens": 0, "history": [], "evals": [], "level": 0, "level_steps": 0,
             "acc_ema": 0.0, "prior": prior}
    state["level"] = args.start_level
    ckpt = args.work / "ckpt.pt"
    if args.resume and ckpt.exists():
        blob = torch.load(ckpt, map_location=dev, weights_only=False)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        state = blob["state"]
        print(f"resumed from {ckpt} at step {state['step']} ({state['wall_s'] / 60:.1f} min)", flush=True)
    print(f"model: {n_params:,} parameters, vocab {len(tokenizer)}, layers {MODEL_CONFIG['layer_types']}", flush=True)
    cur = curriculum(args)
    state["mix"] = task_mix(args)  # the curriculum's, unless --mix sets one for every level
    offset = sum(s["steps"] for s in state["prior"]["stages"])  # steps of earlier stages, for the log
    bar = tqdm(total=args.steps, initial=state["step"], mininterval=20, file=sys.stdout, dynamic_ncols=False,
               ncols=110)
    ema = None
    last_step = min(args.steps, args.stop_at or args.steps)
    while state["step"] < last_step and state["wall_s"] < args.max_minutes * 60:
        loss, per_task = train_step(model, opt, args, state, cur, ids, dev, offset)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        bar.set_postfix_str(f"loss {ema:.3f} " + " ".join(f"{t[:4]} {a:.2f}" for t, a in per_task.items() if a is not None)
                            + f" {state['tokens'] / max(state['wall_s'], 1e-9):.0f} tok/s", refresh=False)
        bar.update(1)
        if state["step"] % args.eval_every == 0 or state["step"] == args.steps:
            acc = heldout_accuracy(model, ids)
            state["evals"].append({"step": offset + state["step"], "wall_s": round(state["wall_s"], 1), **acc})
            print(f"\n[eval] step {state['step']} {state['wall_s'] / 60:.1f} min: "
                  + " ".join(f"{t} {100 * a:.1f}%" for t, a in acc.items()), flush=True)
        if state["step"] % args.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, state)
    bar.close()
    save_checkpoint(ckpt, model, opt, state)
    if not state["evals"] or state["evals"][-1]["step"] != offset + state["step"]:
        acc = heldout_accuracy(model, ids)
        state["evals"].append({"step": offset + state["step"], "wall_s": round(state["wall_s"], 1), **acc})
    command = os.environ.get("HYPIC_TRAIN_COMMAND") or "python -m bench.quality.train " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    export(model.cpu(), tokenizer, args.out, state, args, command)
    print(f"done: {state['step']} steps, {state['wall_s'] / 60:.1f} min, {n_params:,} parameters -> {args.out}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
