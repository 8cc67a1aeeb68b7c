"""bench/anatomy.py on a real mesh of the bundled model: a warm request longer than the router's
default prompt budget (5 x 1000 + 16 tokens; segments under the cut length, so that each is one entry) is served with every segment a
segcache hit, and the hops and the floor are measured."""
from __future__ import annotations

import json

import pytest


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_warm_request_over_the_default_budget_is_all_hits(tmp_path):
    from bench import anatomy

    out = anatomy.main(["--random-model", "", "--segments", "5", "--seg-tokens", "1000", "--reps", "2",
                        "--out", str(tmp_path / "anatomy.json")])
    (row,) = out["models"]
    mesh = row["mesh"]
    assert mesh["segments"] == 5 and mesh["hits"] == 5 and mesh["reps"] == 2
    assert 0 < mesh["transfer_s"] < mesh["client_ttft_s"] and mesh["compose_s"] > 0
    assert row["floor"]["floor_s"] > 0 and row["ttft_over_floor"] > 1
    assert json.loads((tmp_path / "anatomy.json").read_text())["models"][0]["model"] == "hypic-tiny-qwen35"
