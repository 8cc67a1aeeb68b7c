"""The benchmarks' figures (PNG), and `pyplot()`, the one place where bench imports matplotlib."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.cold_model import PARTITIONS
from common.engine.modes import LABELS



def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display). Imported here, lazily: it takes
    seconds to import and only a run that writes its figures needs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {"full": "#7f7f7f", "prefix": "#ff7f0e", "additive": "#9467bd", "hypic": "#2ca02c"}


def plot_cdf(closed: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(closed), figsize=(5 * len(closed), 3.8), squeeze=False)
    for ax, (shape, d) in zip(axes[0], closed.items()):
        for mode, s in d["modes"].items():
            xs = s["ttft_s"]
            if xs:
                ax.step([xs[0]] + xs, np.arange(0, len(xs) + 1) / len(xs), where="post",
                        label=LABELS[mode], color=COLORS[mode])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        tr = d["trace"]
        ax.set_title(f"{shape}: {tr['segments_mean']:.1f} segs, {tr['prompt_tokens_mean']:.0f} tok")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate(sweep: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, d in sweep["modes"].items():
        pts = d["points"]
        ax.plot([p["rate"] for p in pts], [p["ttft_p90_s"] for p in pts], marker="o", color=COLORS[mode],
                label=f"{LABELS[mode]} p90")
        ax.plot([p["rate"] for p in pts], [p["ttft_p50_s"] for p in pts], marker=".", ls="--",
                color=COLORS[mode], alpha=0.6, label=f"{LABELS[mode]} p50")
    ax.axhline(sweep["slo_s"], color="red", ls=":", label=f"SLO {sweep['slo_s']:.2f} s")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (req/s, Poisson)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("RAG: TTFT vs Poisson rate (each mode searched for its SLO bracket)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cold(cold: dict, path: Path) -> None:
    plt = pyplot()

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    meas = cold["measured"]
    labels = ["full recompute", "hypic cold m=1", "hypic cold m=2"]
    vals = [meas["full_ttft_s"], meas["m1_ttft_s"], meas["m2_ttft_s"]]
    a0.bar(labels, vals, color=["#888888", "#1f77b4", "#2ca02c"])
    for x, v in enumerate(vals):
        a0.text(x, v, f"{v:.2f} s", ha="center", va="bottom")
    a0.set_ylabel("TTFT (s, median)")
    a0.set_title(f"measured: cold {meas['prompt_tokens']}-token request, {meas['segments']} segments")
    sim = cold["simulated"]
    for how, mk in zip(PARTITIONS, "osv"):
        rows = [r for r in sim["rows"] if r["partition"] == how]
        a1.plot([r["m"] for r in rows], [r["speedup_vs_m1"] for r in rows], marker=mk, label=how)
    ms = sorted({r["m"] for r in sim["rows"]})
    a1.plot(ms, ms, ls=":", color="grey", label="linear")
    a1.set_xscale("log", base=2)
    a1.set_xticks(ms, [str(m) for m in ms])
    a1.set_xlabel("scatter workers m")
    a1.set_ylabel("cold TTFT speedup vs m = 1")
    a1.set_title(f"SIMULATED: {sim['prompt_tokens']}-token request, {len(sim['lengths'])} segments")
    a1.legend()
    a1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def plot_replay(res: dict, path: Path) -> None:
    """Cold TTFT speedup over m = 1 against m: arrived runs per partitioning, in order (LPT), the
    builds alone and a zero-cost combine (LPT)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pick = lambda policy, how: [r for r in res["rows"] if r["policy"] == policy and r["partition"] == how]  # noqa: E731
    lpt = pick("runs", "lpt")
    ms = [r["m"] for r in lpt]
    for how, mk in zip(PARTITIONS, "osv"):
        rows = pick("runs", how)
        ax.plot([r["m"] for r in rows], [r["speedup_vs_m1"] for r in rows], marker=mk, label=f"arrived runs, {how}")
    rows = pick("in_order", "lpt")
    ax.plot(ms, [r["speedup_vs_m1"] for r in rows], marker="o", ls="--", color="grey", label="in order, lpt")
    ax.plot(ms, [r["speedup_zero_cost_combine"] for r in lpt], ls="-.", color="black",
            label="zero-cost combine, lpt (bound)")
    ax.plot(ms, [lpt[0]["makespan_s"] / r["makespan_s"] for r in lpt], ls=":", color="black",
            label="builds alone, lpt")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("scatter workers m")
    ax.set_ylabel("cold TTFT speedup vs m = 1")
    ax.set_title(f"SIMULATED arrivals, REPLAYED combine: {res['prompt_tokens']}-token request, "
                 f"{len(res['lengths'])} segments", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
