"""bench/report_models.py's table of the five workloads' closed loops on the mid-size model
(serve_random_shapes.json): a row per workload in the run's order, the best baseline named per
row, a mode the run left out shown as a dash, and how the warm-up went."""
from __future__ import annotations

from bench.report_models import random_shapes_section


def shapes_run(p50s: dict[str, dict[str, float]], steady: dict | None = None) -> dict:
    closed = {w: dict(trace=dict(segments_mean=3.0, prompt_tokens_mean=900.0),
                      modes={m: dict(ttft_p50_s=v, hit_rate=None if m == "full" else 0.7) for m, v in p.items()})
              for w, p in p50s.items()}
    warm = dict(requests={w: 8 for w in p50s}, **({"steady": steady} if steady else {}))
    return dict(command="python -m bench.serve --random-model hidden=1024 --no-sweep --out /tmp/x", wall_s=600.0,
                machine=dict(cpus=2, loadavg_start=[1.0, 1.0, 1.0], loadavg_end=[2.0, 2.0, 2.0]),
                closed=closed, warm_up=warm)


def test_a_row_per_workload_with_the_best_baseline_named():
    rs = shapes_run({"rag": dict(full=4.0, prefix=3.0, hypic=1.0), "chat": dict(full=0.5, prefix=0.2, hypic=0.4)})
    text = "\n".join(random_shapes_section(rs))
    assert text.index("| rag (3.0 segs, 900 tok) | 4,000 / 3,000 / 1,000 | 70% | 3.00× vs prefix cache |") < \
        text.index("| chat (3.0 segs, 900 tok) | 500 / 200 / 400 | 70% | 0.50× vs prefix cache |")
    assert "--out" not in text and "rag 8 requests; chat 8 requests" in text
    assert random_shapes_section(None) == []


def test_a_mode_left_out_is_a_dash_and_a_steady_warm_up_says_its_rounds():
    steady = {"rag": dict(rounds=5, reached=True), "agent": dict(rounds=6, reached=False)}
    rs = shapes_run({"agent": dict(full=1.0, hypic=0.5)}, steady)
    text = "\n".join(random_shapes_section(rs))
    assert "| 1,000 / — / 500 |" in text and "2.00× vs full recompute" in text
    assert "rag 5 rounds, agent 6 rounds (capped)" in text
