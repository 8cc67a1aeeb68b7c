"""bench.demo (`make demo`): its session answered right through a real mesh on the bundled model,
cold first and then warm with the documents reordered, in both modes; and its closing sentence says
which way the TTFT comparison went. Correctness only: the speed it prints is not asserted here."""
from __future__ import annotations

import pytest

import hypic
from bench import demo
from hypic.launcher import DEFAULT_MODEL, Mesh

pytestmark = pytest.mark.timeout(300)


def test_documents_are_long_enough_for_reuse_to_matter() -> None:
    docs, questions = demo.session(5)
    lengths = [len(d.split()) for d in docs]
    assert len(docs) == 8 and min(lengths) >= 400 and max(lengths) <= 620, lengths
    assert len({q for q, _ in questions}) == 5  # five different questions


@pytest.mark.processes
@pytest.mark.slow
def test_the_session_is_answered_right_cold_then_warm_in_both_modes(tmp_path) -> None:
    docs, questions = demo.session(3)
    with Mesh(DEFAULT_MODEL, tmp_path / "data", n_scatter=2, threads=1, start_timeout_s=150,
              extra_args=demo.MESH_ARGS) as mesh, \
            hypic.Client(mesh.router_address, timeout=120) as client:
        rows = list(demo.run_session(client, docs, questions, repeats=2))
    assert [r.cache for r in rows] == ["cold", "warm", "warm"]
    assert [len(r.answers["hypic"]) for r in rows] == [1, 2, 2]
    for row in rows:
        for mode in demo.MODES:
            assert row.answers[mode] == [row.expected] * len(row.answers[mode]), (row.question, mode)
            assert all(t > 0 for t in row.ttft_s[mode])
    report = demo.report(rows, docs, tokens=4000)
    assert report[0] == "answers right: hypic 5/5 requests, full 5/5 requests"


def test_the_verdict_says_faster_or_slower_as_measured() -> None:
    assert demo.verdict(0.1, 0.31) == "warm hypic TTFT is 3.1x faster than full recompute (100.0 ms vs 310.0 ms)"
    assert demo.verdict(0.26, 0.2) == "warm hypic TTFT is 1.3x SLOWER than full recompute (260.0 ms vs 200.0 ms)"
    assert "equals" in demo.verdict(0.2, 0.2)


def test_the_report_compares_warm_requests_only_and_counts_wrong_answers() -> None:
    cold = demo.Row("<q> find a <a>", "x", "cold", {"hypic": ["x"], "full": ["x"]}, {"hypic": [0.9], "full": [1.0]})
    warm = demo.Row("<q> find b <a>", "y", "warm", {"hypic": ["y", "z"], "full": ["y", "y"]},
                    {"hypic": [0.1, 0.3], "full": [1.0, 1.4]})
    lines = demo.report([cold, warm], ["d"] * 8, tokens=4000)
    assert lines[0] == "answers right: hypic 2/3 requests, full 3/3 requests"
    assert lines[1] == "cold hypic TTFT (scatter builds all 8 documents): 900.0 ms"
    # p50 of the warm requests only: hypic 200 ms, full 1200 ms (the cold row's 0.9 / 1.0 s left out)
    assert lines[2].startswith("warm hypic TTFT is 6.0x faster than full recompute (200.0 ms vs 1200.0 ms)")
    assert not warm.right("hypic") and warm.right("full")
