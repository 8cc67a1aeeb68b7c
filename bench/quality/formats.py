"""Entry storage formats in the quality evaluation (issue 28 item 3): the same prompts, the same
weights, hypic's entries stored in fp32, bf16, fp8t or fp8 (common.engine.pic.compact), paired.

    python -m bench.quality.eval --entry-formats fp32 bf16 fp8t fp8 [--n 500]   # quality_formats.{json,md}, model README

Mode `hypic_w8@bf16` takes the path the mesh takes with `entry_format: bf16` in its worker config: a
HybridEngine whose `entry_format` is the format builds each segment's entry (`build_entry`: T and S,
and with fp8 keys and values, rounded as the entry's bytes hold them), the entry goes through its bytes (what segcache stores and
a combine reads) and the combine's check (`check_entry`: an entry in another format is refused),
and `prefill_segments` composes the parsed entries. `hypic_w8@fp32` is the same path at fp32 (the
same numbers as eval's `hypic_w8`).

Paired against the reference format (fp32) on every prompt: whether the decoded answers are the
same, which of the two is right where they differ, and KL(fp32 entries || format) of the
next-token distributions at the query (fp64 arithmetic: the figures are far below fp32's
resolution of a KL summed over the vocabulary).
"""
from __future__ import annotations

import copy

import torch

from common.engine.dtypes import check_entry_format
from common.engine.modes import seam_for
from common.engine.pic.entry import SegmentEntry

REFERENCE = "fp32"  # the format the others are paired against
FORMAT_SEAM = 8  # hypic's default seam window (common.engine.modes)

_AT_FORMAT: dict[str, object] = {}  # format -> the engine at that format (sharing the weights)


def format_mode(fmt: str, seam: int = FORMAT_SEAM) -> str:
    return f"hypic_w{seam}@{check_entry_format(fmt)}"


def parse_format_mode(name: str) -> tuple[int, str]:
    """'hypic_w8@bf16' -> (8, 'bf16')."""
    head, fmt = name.split("@")
    if not head.startswith("hypic_w"):
        raise ValueError(f"not an entry-format mode: {name!r}")
    return int(head[len("hypic_w"):]), check_entry_format(fmt)


def label(name: str) -> str:
    seam, fmt = parse_format_mode(name)
    return f"hypic w={seam}, {fmt} entries"


def engine_at(engine, fmt: str):
    """`engine` with entry_format `fmt`: a shallow copy sharing its model (what a worker configured
    with that format serves), made once per format per process."""
    cached = _AT_FORMAT.get(fmt)
    if cached is None or cached.model is not engine.model:
        cached = copy.copy(engine)
        cached.entry_format = check_entry_format(fmt)
        _AT_FORMAT[fmt] = cached
    return cached


def prefill_at_format(engine, segments, query, name: str, order: str):
    """One prompt in mode `name` (hypic_w{seam}@{fmt}) through the mesh's path: build at the
    format, to bytes and back, the combine's check, compose."""
    seam, fmt = parse_format_mode(name)
    eng = engine_at(engine, fmt)
    entries = []
    for seg in segments:
        entry = SegmentEntry.from_bytes(eng.build_entry(seg, seam).to_bytes())
        eng.check_entry(entry, seg, seam_for("hypic", seam))
        entries.append(entry)
    return eng.prefill_segments(segments, query, entries=entries, mode="hypic", seam=seam, order=order)


def kl64(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats over the vocabulary, in fp64."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return max(float((p.exp() * (p - q)).sum()), 0.0)


def pair(res: dict, logits: dict) -> None:
    """Add to each format mode's result its pairing with the reference format's on this prompt:
    `same` (the decoded answers are equal) and `kl_ref` (KL(reference || mode) at the query)."""
    ref = next((m for m in res if "@" in m and m.endswith("@" + REFERENCE)), None)
    if ref is None:
        return
    for m in res:
        if "@" in m and m != ref:
            res[m]["same"] = res[m]["pred"] == res[ref]["pred"]
            res[m]["kl_ref"] = kl64(logits[ref], logits[m])


def collect(paired: dict, task: str, res: dict) -> None:
    """Gather one prompt's pairing into paired[task][mode] = {"same", "kl", "ok", "ref_ok"} lists."""
    ref = next((m for m in res if m.endswith("@" + REFERENCE)), None)
    for m, r in res.items():
        if "same" in r:
            p = paired.setdefault(task, {}).setdefault(m, {"same": [], "kl": [], "ok": [], "ref_ok": []})
            p["same"].append(r["same"])
            p["kl"].append(r["kl_ref"])
            p["ok"].append(r["ok"])
            p["ref_ok"].append(res[ref]["ok"])


def paired_figures(paired: dict, interval) -> dict:
    """{"paired": {task: {mode: figures}}} from collect's lists (nothing without format modes):
    prompts whose answers differ from the reference's (count and the 95% interval of the share that
    `interval(k, n)` gives: eval's Wilson interval, passed in since eval imports this module),
    prompts only the reference got right / only the mode got right, the accuracy difference in
    points (what those two counts give), and the mean and largest KL(reference || mode)."""
    if not paired:
        return {}

    def figures(p: dict) -> dict:
        n, differ = len(p["same"]), p["same"].count(False)
        ref_only = sum(r and not o for r, o in zip(p["ref_ok"], p["ok"]))
        mode_only = sum(o and not r for r, o in zip(p["ref_ok"], p["ok"]))
        return {"n": n, "differ": differ, "differ_pct_interval95": list(interval(differ, n)),
                "reference_only_right": ref_only, "format_only_right": mode_only,
                "delta_pts": 100.0 * (mode_only - ref_only) / n,
                "kl_vs_reference_mean": sum(p["kl"]) / n, "kl_vs_reference_max": max(p["kl"])}

    return {"reference_format": REFERENCE,
            "paired": {t: {m: figures(p) for m, p in per_mode.items()} for t, per_mode in paired.items()}}


def paired_table(res: dict) -> list[str]:
    """Markdown lines for the paired figures (nothing for results without them)."""
    if "paired" not in res:
        return []
    ref = res["reference_format"]
    lines = ["", f"Paired with {ref} entries, prompt by prompt: answers that differ (of n; 95% Wilson interval "
             f"of the share, %), prompts only {ref} entries answer right / only the format does, the accuracy "
             f"difference in points, and KL({ref} entries || format) at the query (nats, mean / largest):", "",
             "| task | mode | n | answers differ | only " + ref + " right | only format right | difference, pts "
             "| KL mean | KL max |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t, per_mode in res["paired"].items():
        for m, f in per_mode.items():
            lo, hi = f["differ_pct_interval95"]
            lines.append(f"| {t} | {label(m)} | {f['n']} | {f['differ']} [{lo:.1f}, {hi:.1f}] | "
                         f"{f['reference_only_right']} | {f['format_only_right']} | {f['delta_pts']:+.1f} | "
                         f"{f['kl_vs_reference_mean']:.1e} | {f['kl_vs_reference_max']:.1e} |")
    return lines
