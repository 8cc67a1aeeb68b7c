"""bench/report_cut.py: the section on cutting long segments is rendered from the committed
results (quality_cut.json, cold_cut.json, cold_cut_mesh.json), its figures computed, not typed,
and left out when none of them exists."""
from __future__ import annotations

from pathlib import Path

from bench import report
from bench.report_cut import cut_section, load_cut

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_cut_section_shows_the_committed_results() -> None:
    cut = load_cut(RESULTS)
    assert cut is not None and set(cut) == {"quality", "sim", "mesh"}
    text = "\n".join(cut_section(cut))
    top = max(r["m"] for r in cut["sim"]["rows"])
    fast = max((r for r in cut["sim"]["rows"] if r["m"] == top), key=lambda r: r["speedup_vs_whole_m1"])
    assert f"the fastest is L = {fast['cut_tokens']}: {fast['speedup_vs_whole_m1']:.2f}×" in text
    assert f"**{cut['mesh']['speedup_cut_vs_whole']:.2f}×**" in text
    for t in cut["quality"]["tasks"]:
        assert f"| {t} | " in text
    assert "### Cutting long segments" in (RESULTS.parents[1] / "docs" / "results.md").read_text()
    assert report.main(["--check"]) == 0


def test_no_cut_results_no_section(tmp_path: Path) -> None:
    assert load_cut(tmp_path / "results") is None
