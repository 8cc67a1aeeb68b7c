"""bench/report_workloads.py: the five-workload table of docs/results.md, from serve_<workload>.json
runs: each row's figures, the best baseline named per ratio, the sweep's hit rate weighted by
requests, and the files read in the workloads' order."""
from __future__ import annotations

import json

from bench import report_workloads as R

PARAMS = dict(concurrency=1, n_closed=10, n_summ=6, n_agent=12, n_chat=12, n_fewshot=12, rate_window=8.0,
              n_rate_min=6, n_rate_max=32, rates_x=[0.5, 1, 2], slo_x=3.0)


def run(shape: str, p50: dict, qps: dict, hit_points=((6, 0.5), (18, 0.7))) -> dict:
    """A bench.serve result of one workload with these closed-loop p50s (s) and QPS at the SLO."""
    modes = {m: dict(ttft_p50_s=v, ttft_p99_s=2 * v, hit_rate=None if m == "full" else 0.25) for m, v in p50.items()}
    modes["hypic"]["hit_rate"] = 0.8
    pts = lambda m: [dict(rate=0.5, n=n, ttft_p90_s=1.0, hit_rate=None if m == "full" else h)  # noqa: E731
                     for n, h in hit_points]
    return dict(command=f"python -m bench.serve --workload {shape} --out /tmp/x", params=PARAMS, shape=shape,
                machine=dict(cpus=2, loadavg_start=[3.0], loadavg_end=[5.5]),
                closed={shape: dict(trace=dict(segments_mean=4.5, prompt_tokens_mean=1800.0), modes=modes)},
                sweep=dict(slo_s=1.5, rates=[0.5], modes={m: dict(interpolated_qps=q, points=pts(m),
                                                                  lower_bound=m == "hypic" and q > 10)
                                                          for m, q in qps.items()}))


def test_a_row_names_the_best_baseline_of_each_ratio():
    s = run("chat", p50=dict(full=1.0, prefix=0.5, hypic=0.25), qps=dict(full=2.0, prefix=1.0, hypic=3.0))
    row = R.workload_row("chat", s)
    assert row.startswith("| chat (4.5 segs, 1800 tok) | 1,000 / 500 / 250 | 2,000 / 1,000 / 500 | 1.50 | "
                          "2.00 / 1.00 / 3.00 | ")
    # TTFT: prefix was the faster baseline (0.5 / 0.25); QPS: full recompute (3 / 2)
    assert "| 2.00× vs prefix cache | 1.50× vs full recompute |" in row
    assert R.sweep_hit_rate(s["sweep"]) == (6 * 0.5 + 18 * 0.7) / 24  # weighted by requests, not points
    assert "| 80% / 65% | 25% |" in row  # hypic closed loop / sweep, prefix (replayed)
    top = R.workload_row("chat", run("chat", p50=dict(full=1.0, prefix=0.5, hypic=0.25),
                                     qps=dict(full=2.0, prefix=1.0, hypic=12.0)))
    assert "| 2.00 / 1.00 / ≥12.00 |" in top  # hypic never missed the SLO: a lower bound


def test_the_section_reads_the_runs_in_the_workloads_order(tmp_path):
    for shape in ("fewshot", "rag"):  # written out of order; serve_trace.json is not a workload
        (tmp_path / f"serve_{shape}.json").write_text(json.dumps(
            run(shape, p50=dict(full=1.0, prefix=1.2, hypic=0.5), qps=dict(full=1.0, prefix=0.8, hypic=2.0))))
    (tmp_path / "serve_trace.json").write_text("{}")
    runs = R.load_workloads(tmp_path)
    assert list(runs) == ["rag", "fewshot"]
    text = "\n".join(R.workloads_section(runs))
    assert text.count("| rag (") == 1 and text.index("| rag (") < text.index("| fewshot (")
    assert "--out" not in text and "rag 3.0 → 5.5; fewshot 3.0 → 5.5" in text
    assert R.workloads_section({}) == []
    assert R.ladders(runs) == "0.5, 1, 2"
    runs["fewshot"]["params"] = {**PARAMS, "rates_x": [0.25, 0.5]}
    assert R.ladders(runs) == "0.5, 1, 2 (rag); 0.25, 0.5 (fewshot)"


def test_a_workload_where_hypic_is_slower_is_named_with_its_prompt_and_both_times():
    fast = run("rag", p50=dict(full=1.0, prefix=1.2, hypic=0.5), qps=dict(full=1.0, prefix=0.8, hypic=2.0))
    slow = run("chat", p50=dict(full=0.022, prefix=0.014, hypic=0.038), qps=dict(full=11.0, prefix=24.0, hypic=2.0))
    assert R.slower_lines({"rag": fast}) == []
    text = " ".join(R.slower_lines({"rag": fast, "chat": slow}))
    assert "chat: 1800 tokens in 4.5 segments, hypic 38 ms against 14 ms" in text and "rag:" not in text
    assert " ".join(R.workloads_section({"rag": fast, "chat": slow})).endswith(text)
