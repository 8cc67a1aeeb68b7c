"""bench.report: the README's results section is what the committed JSON renders to, and it shows
the mid-size random-weight model's RAG ratios and the warm-path anatomy beside the bundled model's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import report
from bench.random_model import RANDOM_LABEL

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_readme_results_are_what_the_json_renders_to() -> None:
    assert report.main(["--check"]) == 0


def test_section_shows_both_models_ratios() -> None:
    serve, cold, rnd, anatomy = report.load(RESULTS)
    assert rnd is not None and anatomy is not None, "serve_random.json and anatomy.json are committed"
    section = report.render(serve, cold, rnd, anatomy)
    bundled = serve["headline"]["ttft_p50_ratio_hypic_vs_prefix"]
    mid = rnd["headline"]["ttft_p50_ratio_hypic_vs_prefix"]
    assert RANDOM_LABEL in section
    assert f"| hypic vs prefix cache, TTFT p50 (RAG) | {bundled:.2f}× |" in section
    assert f"| hypic vs prefix cache, TTFT p50 (RAG), mid-size random-weight model | {mid:.2f}× |" in section
    qps = rnd["headline"].get("qps_at_slo_ratio_hypic_vs_prefix")
    if qps is not None:
        assert f"mid-size random-weight model | {qps:.2f}× |" in section
    for row in anatomy["models"]:
        assert f"{row['ttft_over_floor']:.2f}×" in section
    assert "loaded CPU" in section  # the README says the machine was loaded


def test_optional_results_are_left_out_when_absent(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "serve.json", tmp_path / "serve.json")
    serve, cold, rnd, anatomy = report.load(tmp_path)
    assert (cold, rnd, anatomy) == (None, None, None)
    section = report.render(serve, cold, rnd, anatomy)
    assert RANDOM_LABEL not in section and "### Warm path" not in section
    readme = tmp_path / "README.md"
    readme.write_text("# title\n")
    assert report.main(["--results", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n") and report.START in text and report.END in text
    assert report.main(["--results", str(tmp_path), "--readme", str(readme), "--check"]) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    data["headline"]["ttft_p50_ratio_hypic_vs_prefix"] += 1.0
    (tmp_path / "serve.json").write_text(json.dumps(data))
    assert report.main(["--results", str(tmp_path), "--readme", str(readme), "--check"]) == 1


def test_command_shown_without_its_output_path() -> None:
    assert report.command({"command": "python -m bench.serve --out /tmp/x --shapes rag"}) == \
        "python -m bench.serve --shapes rag"
    assert report.command({"command": "python -m bench.serve --quick"}) == "python -m bench.serve --quick"
