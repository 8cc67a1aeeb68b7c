"""docs/results.md's five-workload table: one `python -m bench.serve --workload W` run per workload
(bench/results/serve_<workload>.json: RAG, summarization, agent, chat, few-shot), each with its own
closed loop and QPS sweep on that workload, every ratio against the best baseline at its point
(bench/report_baseline.py)."""
from __future__ import annotations

from pathlib import Path

from bench import results_json
from bench.report_baseline import named, named_qps, vs_best
from bench.report_format import command, machine_words, ms, pct
from bench.workloads import SHAPES

MODES3 = ("full", "prefix", "hypic")  # what each workload run compares (--modes)


def load_workloads(results: Path) -> dict[str, dict]:
    """{workload: its serve_<workload>.json} for the runs that exist, in SHAPES order."""
    return {w: results_json.load(results / f"serve_{w}.json") for w in SHAPES
            if (results / f"serve_{w}.json").exists()}


def sweep_hit_rate(sw: dict, mode: str = "hypic") -> float | None:
    """The hit rate over every request of `mode`'s sweep points (weighted by their requests)."""
    pts = [p for p in sw["modes"][mode]["points"] if p.get("hit_rate") is not None]
    n = sum(p["n"] for p in pts)
    return sum(p["hit_rate"] * p["n"] for p in pts) / n if n else None


def _slash(values) -> str:
    return " / ".join(values)


def workload_row(w: str, s: dict) -> str:
    closed = s["closed"][w]
    tr, modes = closed["trace"], closed["modes"]
    best = vs_best(s)
    sw = s.get("sweep")
    # ≥: the mode met the SLO at every rate it ran, up to the top of the ladder (a lower bound)
    qps = _slash(("≥" if sw["modes"][m]["lower_bound"] else "") + f"{sw['modes'][m]['interpolated_qps']:.2f}"
                 for m in MODES3) if sw else "—"
    slo = f"{sw['slo_s']:.2f}" if sw else "—"
    hits = f"{pct(modes['hypic']['hit_rate'])} / {pct(sweep_hit_rate(sw)) if sw else '—'}"
    return (f"| {w} ({tr['segments_mean']:.1f} segs, {tr['prompt_tokens_mean']:.0f} tok) | "
            f"{_slash(ms(modes[m]['ttft_p50_s']) for m in MODES3)} | {_slash(ms(modes[m]['ttft_p99_s']) for m in MODES3)} | "
            f"{slo} | {qps} | {hits} | {pct(modes['prefix']['hit_rate'])} | "
            f"{named(best.get('ttft_p50'))} | {named_qps(s, best.get('qps_at_slo'))} |")


def ladders(runs: dict[str, dict]) -> str:
    """The sweeps' rate ladders (× full recompute's service rate), named per workload when they differ."""
    text = {w: ", ".join(f"{x:g}" for x in s["params"]["rates_x"]) for w, s in runs.items()}
    by_ladder: dict[str, list[str]] = {}
    for w, t in text.items():
        by_ladder.setdefault(t, []).append(w)
    if len(by_ladder) == 1:
        return next(iter(by_ladder))
    return "; ".join(f"{t} ({', '.join(ws)})" for t, ws in by_ladder.items())


def workloads_section(runs: dict[str, dict]) -> list[str]:
    """The table, and how the runs were made (command, requests per point, the machine's load)."""
    if not runs:
        return []
    first = next(iter(runs.values()))
    p = first["params"]
    out = [
        "### Five workloads",
        "",
        "One `python -m bench.serve --workload W --shapes W --tag _W` run per workload "
        f"(`bench/results/serve_<workload>.json`; the first: `{command(first)}`): warm-up, a closed loop "
        f"(concurrency {p['concurrency']}), then the QPS sweep on that workload, in full recompute, prefix cache "
        f"and hypic. Short runs: {p['n_closed']} RAG / {p['n_summ']} summarization / {p['n_agent']} agent / "
        f"{p['n_chat']} chat / {p['n_fewshot']} few-shot closed-loop requests per mode, sweep points of "
        f"{p['rate_window']:g} s of arrivals ({p['n_rate_min']}–{p['n_rate_max']} requests) on the ladder "
        f"{ladders(runs)} × full recompute's service rate; the SLO is "
        f"p90 TTFT ≤ {p['slo_x']:g} × full recompute's closed-loop p50 on that workload. The workloads "
        "(`bench/workloads.py`): RAG over a Zipf-popular corpus; summarization of a few long documents; "
        "agent tool use (a session's tool descriptions, the memory files of the turn, its last turns); "
        "multi-turn chat (a system prompt and the conversation's last turns); few-shot (a task's "
        "instruction and examples drawn from its pool, in random order).",
        "",
        "| workload (closed loop: segments, tokens per prompt) | TTFT p50 (ms) full / prefix / hypic | "
        "TTFT p99 (ms) | SLO (s) | QPS at SLO full / prefix / hypic | hypic hit rate, closed loop / sweep | "
        "prefix hit rate (replayed) | TTFT p50, hypic vs the best baseline | QPS at SLO, hypic vs the best "
        "baseline (≥: hypic met the SLO up to the ladder's top) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    out += [workload_row(w, s) for w, s in runs.items()]
    loads = "; ".join(f"{w} {s['machine']['loadavg_start'][0]:.1f} → {s['machine']['loadavg_end'][0]:.1f}"
                      for w, s in runs.items())
    out += ["", "Hit rates: hypic's are of the cache entries the router looked up (a segment longer than the "
            "cut length counts as its pieces), from the mesh's own timings (every tier); the prefix cache's are "
            "of segments, from the client-side replay of its cache. A QPS at the SLO below the ladder's lowest "
            "rate is interpolated between the closed loop (rate 0) and that rate, which it missed. The runs were one after the other on "
            f"{first['machine']['cpus']} CPU cores {loaded(runs)} (1-minute load average at the start → "
            f"the end: {loads}); each workload's modes ran side by side on "
            "the same requests, so compare within a row. With this few requests per point a p99 is close to "
            "the maximum and a QPS bracket moves between runs.", ""]
    return out + slower_lines(runs)


def loaded(runs: dict[str, dict]) -> str:
    """How the runs shared the machine: alone unless one's load average went over its cores."""
    return ("with no other jobs of note" if all(machine_words(s["machine"])[0] == "with no other jobs of note"
                                                for s in runs.values()) else "shared with other jobs")


def slower_lines(runs: dict[str, dict]) -> list[str]:
    """Where hypic's closed-loop TTFT p50 is above the best baseline's, why: the prompt costs less to
    recompute than hypic's fixed work per request (the anatomy section breaks that work down)."""
    slow = []
    for w, s in runs.items():
        best = vs_best(s).get("ttft_p50")
        if best and best["ratio"] < 1:
            tr = s["closed"][w]["trace"]
            slow.append(f"{w}: {tr['prompt_tokens_mean']:.0f} tokens in {tr['segments_mean']:.1f} segments, "
                        f"hypic {ms(best['hypic'])} ms against {ms(best['value'])} ms")
    if not slow:
        return []
    return [f"Where hypic's TTFT is above the best baseline's ({'; '.join(slow)}), what the baseline recomputes "
            "costs this model less than hypic's fixed work per request: the router's lookup, a read, "
            "seal check and parse per entry, and a composition pass whose per-call cost is above that of its "
            "few seam and query tokens run as one plain forward (the warm path's anatomy below measures each). "
            "That work grows far more slowly with the model than a prefill does, so a larger model wins on "
            "shorter prompts: the mid-size model's section.", ""]
