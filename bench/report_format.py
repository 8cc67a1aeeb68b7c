"""Formatting of bench.report's tables and sentences, and the published figures they are compared
with: *HYPIC: Accelerating Hybrid-Attention LLM Serving with Position-Independent Caching*
(arXiv 2607.01299, 2026), as its abstract reports them (TTFT and QPS against a prefix cache) and as
a press account of the same paper reports the cold path (m = 8 workers, LPT against naive
partitioning)."""
from __future__ import annotations

import math
import statistics

PAPER = ("*HYPIC: Accelerating Hybrid-Attention LLM Serving with Position-Independent Caching* "
         "(arXiv 2607.01299, 2026)")
# the HYPIC paper's figures: TTFT p50 and QPS at a 1 s SLO over a prefix cache (averages over four
# production models on GPUs), a cold 32k-token request on 8 workers, LPT vs uneven partitioning
PUBLISHED = dict(ttft_p50=3.25, qps=1.66, cold_m8=5.7, lpt=3.6, naive_part=2.4)


def ms(x: float | None) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "—" if x is None or math.isnan(x) else "∞"
    return f"{x * 1e3:,.0f}"


def sec(x: float) -> str:
    return f"{x:.2f} s"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def tiers(d: dict) -> str:
    if not d:
        return "—"
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in d.items())


def command(results: dict) -> str:
    """The command that wrote `results`, less its --out (a path on the machine that ran it)."""
    words = results["command"].split()
    keep = [w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out")]
    return " ".join(keep)


def machine_load(mach: dict) -> str:
    return (f"load average {mach['loadavg_start'][0]:.1f} at the start, {mach['loadavg_end'][0]:.1f} at the end "
            f"(1-minute averages; {mach['cpus']:.0f} = one runnable job per core)")


def machine_words(mach: dict) -> tuple[str, str]:
    """(how the cores were shared, what that does to absolute times), from the run's 1-minute load
    averages: a run whose load stayed at or under one runnable job per core had the machine to itself."""
    if max(mach["loadavg_start"][0], mach["loadavg_end"][0]) <= mach["cpus"]:
        return "with no other jobs of note", "Absolute times are this CPU's"
    return "shared with other jobs", "Absolute times are this loaded CPU's and inflated by it"


def short_name(row: dict) -> str:
    """A model's name in a table cell: the bundled model's, or "mid-size random model" (the label
    says what it is where the section introduces it)."""
    return "mid-size random-weight model" if row.get("random_weights") else f"`{row['model']}`"


def hit_split(records: list[dict]) -> tuple[tuple[int, float | None], tuple[int, float | None]] | None:
    """((requests with no miss, their TTFT p50), (requests with a miss, their TTFT p50))."""
    ok = [r for r in records if "ttft_s" in r and "misses" in r]
    if not ok:
        return None
    med = lambda xs: float(statistics.median(xs)) if xs else None  # noqa: E731
    hit = [r["ttft_s"] for r in ok if r["misses"] == 0]
    miss = [r["ttft_s"] for r in ok if r["misses"] > 0]
    return (len(hit), med(hit)), (len(miss), med(miss))


def split_sentence(records: list[dict]) -> str:
    split = hit_split(records)
    if not split:
        return ""
    (n_hit, p50_hit), (n_miss, p50_miss) = split
    return (f" Hypic's RAG requests with every segment cached ({n_hit} of {n_hit + n_miss}): TTFT p50 "
            f"{ms(p50_hit)} ms; with at least one miss ({n_miss}): {ms(p50_miss)} ms.")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
