"""bench.report: docs/results.md and the README's short results section are what the committed JSON
renders to; the full results show the mid-size random-weight model's RAG ratios and the warm-path
anatomy beside the bundled model's, and the cold path from bench.cold's replay (cold_runs.json) with
its bound computed, not typed; the README's table names the published source it compares with."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from bench import cold_model as C
from bench import report
from bench.report_baseline import named, named_qps, vs_best
from bench.report_format import machine_words
from bench.random_model import RANDOM_LABEL

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_readme_results_are_what_the_json_renders_to() -> None:
    assert report.main(["--check"]) == 0


def test_readme_section_is_the_headline_table_and_links_the_full_results() -> None:
    serve, cold, rnd, anatomy, replay = report.load(RESULTS)
    section = report.readme_section(serve, cold, rnd, anatomy, replay)
    assert section.startswith(report.START) and section.endswith(report.END)
    assert len(section.splitlines()) <= 20
    assert "[docs/results.md](docs/results.md)" in section.splitlines()[-2]
    assert report.PAPER in section and "HYPIC: Accelerating Hybrid-Attention LLM Serving" in report.PAPER
    bundled = named(vs_best(serve)["ttft_p50"])
    assert f"| TTFT p50, hypic vs the best baseline (RAG, bundled model) | {bundled} | 3.25× |" in section
    assert f"QPS at SLO (p90 TTFT ≤ {serve['sweep']['slo_s']:.1f} s), hypic vs the best baseline (RAG, bundled model) | " \
        f"{named(vs_best(serve)['qps_at_slo'])} |" in section
    for row in anatomy["models"]:
        assert f"| {row['ttft_over_floor']:.2f}× |" in section
    full = report.render(serve, cold, rnd, anatomy, replay)
    assert report.START not in full and "](bench/results/" not in full  # links from docs/ go up a level


def test_section_shows_both_models_ratios() -> None:
    serve, cold, rnd, anatomy, replay = report.load(RESULTS)
    assert rnd is not None and anatomy is not None, "serve_random.json and anatomy.json are committed"
    section = report.render(serve, cold, rnd, anatomy, replay)
    bundled, mid = vs_best(serve), vs_best(rnd)
    assert RANDOM_LABEL in section
    assert f"| hypic vs the best baseline, TTFT p50 (RAG) | {named(bundled['ttft_p50'])} |" in section
    assert (f"| hypic vs the best baseline, TTFT p50 (RAG), mid-size random-weight model | "
            f"{named(mid['ttft_p50'])} |") in section
    if "qps_at_slo" in mid:
        assert f"mid-size random-weight model | {named_qps(rnd, mid['qps_at_slo'])} |" in section
    assert "vs full recompute" in section and "vs prefix cache" in section  # both won somewhere
    for row in anatomy["models"]:
        assert f"{row['ttft_over_floor']:.2f}×" in section
    assert machine_words(serve["machine"])[1] in section  # how loaded the machine was, from its load averages


def test_the_machine_is_called_loaded_only_when_its_load_went_over_its_cores() -> None:
    idle = dict(cpus=2, loadavg_start=[0.9, 1.0, 1.0], loadavg_end=[2.0, 1.5, 1.2])
    busy = dict(idle, loadavg_end=[8.7, 5.0, 3.0])
    assert machine_words(idle) == ("with no other jobs of note", "Absolute times are this CPU's")
    assert "loaded" in machine_words(busy)[1] and machine_words(busy)[0] == "shared with other jobs"


def test_optional_results_are_left_out_when_absent(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "serve.json", tmp_path / "serve.json")
    serve, cold, rnd, anatomy, replay = report.load(tmp_path)
    assert (cold, rnd, anatomy, replay) == (None, None, None, None)
    section = report.render(serve, cold, rnd, anatomy, replay)
    assert RANDOM_LABEL not in section and "### Warm path" not in section
    readme, doc = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text("# title\n")
    paths = ["--results", str(tmp_path), "--readme", str(readme), "--doc", str(doc)]
    assert report.main(paths) == 0
    text = readme.read_text()
    assert text.startswith("# title\n") and report.START in text and report.END in text
    assert doc.read_text() == section
    assert report.main(paths + ["--check"]) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    data["closed"]["rag"]["modes"]["hypic"]["ttft_p50_s"] *= 2.0
    (tmp_path / "serve.json").write_text(json.dumps(data))
    assert report.main(paths + ["--check"]) == 1
    doc.write_text(report.render(*report.load(tmp_path)))  # the README's table is stale too
    assert report.main(paths + ["--check"]) == 1


def test_command_shown_without_its_output_path() -> None:
    assert report.command({"command": "python -m bench.serve --out /tmp/x --shapes rag"}) == \
        "python -m bench.serve --shapes rag"
    assert report.command({"command": "python -m bench.serve --quick"}) == "python -m bench.serve --quick"


def _replay_row(replay: dict, policy: str, how: str, m: int) -> dict:
    return next(r for r in replay["rows"] if (r["policy"], r["partition"], r["m"]) == (policy, how, m))


def _results_copy(tmp_path: Path, *names: str) -> Path:
    for name in names:
        shutil.copy(RESULTS / name, tmp_path / name)
    return tmp_path


def test_cold_section_renders_the_replay_from_its_json(tmp_path: Path) -> None:
    """Every replay figure in the section comes from cold_runs.json: a changed figure in a copy of
    the JSON changes the table, the m = 8 paragraph and the closing row, and --check notices."""
    d = _results_copy(tmp_path, "serve.json", "cold.json", "cold_runs.json")
    before = report.render(*report.load(d))
    replay = json.loads((d / "cold_runs.json").read_text())
    top = max(r["m"] for r in replay["rows"])
    r = _replay_row(replay, "runs", "lpt", top)
    assert f"**{r['speedup_vs_m1']:.2f}×** over m = 1" in before
    assert f"{r['ttft_s']:.2f} s ({r['speedup_vs_m1']:.2f}×; tail {r['tail_after_last_arrival_s'] * 1e3:,.0f} ms)" \
        in before
    assert f"would reach **{r['speedup_zero_cost_combine']:.2f}×**" in before
    assert "**Simulated arrivals, replayed combine**" in before
    assert "| lpt | in order (old) |" in before and "| lpt | arrived runs (now) |" in before
    assert "composing in order at the measured" not in before  # the old simulation's paragraph is gone
    r.update(ttft_s=9.87, speedup_vs_m1=7.77, tail_after_last_arrival_s=0.321, speedup_zero_cost_combine=8.88)
    (d / "cold_runs.json").write_text(json.dumps(replay))
    after = report.render(*report.load(d))
    assert "9.87 s (7.77×; tail 321 ms)" in after and "9.87 s (7.77×" not in before
    assert "**7.77×** over m = 1" in after
    closing = f"| cold speedup, m = {top}, 32k-token request, LPT (**simulated** arrivals, **replayed** combine) |"
    assert f"{closing} 7.77×" in after
    assert "would reach **8.88×**" in after and "| the same with a combine costing nothing (bound) | 8.88×" in after
    readme, doc = d / "README.md", d / "results.md"
    readme.write_text(report.splice("# t\n", report.readme_section(*report.load(d))))
    doc.write_text(before)
    assert report.main(["--results", str(d), "--readme", str(readme), "--doc", str(doc), "--check"]) == 1
    doc.write_text(after)
    assert report.main(["--results", str(d), "--readme", str(readme), "--doc", str(doc), "--check"]) == 0


def assert_same_figures(got, want, where: str = "") -> None:
    """`got` equals `want` key for key, floats to 1e-12 relative (the last bits of a sum depend on
    numpy's summation order, which moves between its releases)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_same_figures(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_figures(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), where
    else:
        assert got == want, where


def test_cold_bound_is_the_arithmetic_of_the_replay() -> None:
    """bench.cold_model.reprice recomputes the committed TTFTs, speedups and bound exactly from the
    replayed passes; the bound is overhead + last arrival + query, never above a replayed TTFT;
    the paragraph's 'longest build alone' holds."""
    replay = json.loads((RESULTS / "cold_runs.json").read_text())
    again = C.reprice(copy.deepcopy(replay), replay["overhead_s"], replay["overhead_source"])
    assert_same_figures(again, replay)
    ov, q = replay["overhead_s"], replay["query_s"]
    for r in replay["rows"]:
        assert r["ttft_s"] == pytest.approx(ov + r["combine_done_s"] + q, rel=1e-12)
        assert r["ttft_zero_cost_combine_s"] == pytest.approx(ov + r["makespan_s"] + q, rel=1e-12)
        assert r["ttft_zero_cost_combine_s"] <= r["ttft_s"]
    top = max(r["m"] for r in replay["rows"])
    r = _replay_row(replay, "runs", "lpt", top)
    cost = C.fit_cost_model(replay["cost_model"]["observations"])
    assert r["makespan_s"] == pytest.approx(cost.predict(max(replay["lengths"])), rel=1e-9)
    cold = json.loads((RESULTS / "cold.json").read_text())
    section = report.render(json.loads((RESULTS / "serve.json").read_text()), cold, None, None, replay)
    assert "longest segment's build alone" in section


def test_cold_section_follows_a_repriced_overhead(tmp_path: Path) -> None:
    """A different fixed overhead (reprice) moves every replay figure, the bound with them, and
    the section says where the overhead came from."""
    d = _results_copy(tmp_path, "serve.json", "cold.json", "cold_runs.json")
    replay = json.loads((d / "cold_runs.json").read_text())
    zero = C.reprice(copy.deepcopy(replay), 0.0, "--overhead-s")
    top = max(r["m"] for r in zero["rows"])
    r = _replay_row(zero, "runs", "lpt", top)
    assert r["speedup_vs_m1"] == pytest.approx(r["speedup_vs_m1_compute_only"])
    assert r["speedup_zero_cost_combine"] == pytest.approx(r["speedup_zero_cost_combine_compute_only"])
    assert r["speedup_zero_cost_combine"] > _replay_row(replay, "runs", "lpt", top)["speedup_zero_cost_combine"]
    (d / "cold_runs.json").write_text(json.dumps(zero))
    section = report.render(*report.load(d))
    assert f"would reach **{r['speedup_zero_cost_combine']:.2f}×**" in section
    assert "fixed overhead 0 ms" in section and "from --overhead-s" in section


def test_cold_section_without_replay_keeps_the_in_order_simulation(tmp_path: Path) -> None:
    d = _results_copy(tmp_path, "serve.json", "cold.json")
    serve, cold, rnd, anatomy, replay = report.load(d)
    assert replay is None and cold is not None
    section = report.render(serve, cold, rnd, anatomy, replay)
    assert "![cold path](../bench/results/cold.png)" in section and "cold_runs" not in section
    assert f"LPT (**simulated**) | {serve['headline']['sim_speedup']['lpt']:.2f}×" in section
