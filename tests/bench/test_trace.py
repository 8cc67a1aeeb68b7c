"""bench/trace.py, the JSONL trace of reuse workloads (Mooncake's fields plus the segments):
write -> read round trips, Mooncake's hash_ids semantics, malformed lines refused by line, the
arrivals scaled for the sweep, and a replay of a tiny trace through `bench.serve --trace` on a
real mesh of the bundled model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import remote
from bench import trace as TR
from bench import workloads as W


def generated() -> dict[str, W.Trace]:
    corpus = W.make_corpus(30, (128, 1024), seed=1)
    pool = W.make_corpus(6, (768, 2048), seed=2, first_id=100_000)
    return {"rag": W.rag_trace(corpus, 12, seed=3, rate=2.0),
            "summarization": W.summarization_trace(pool, 6, seed=3, rate=1.0),
            "agent": W.agent_trace(12, seed=3, rate=3.0), "chat": W.chat_trace(12, seed=3, rate=3.0),
            "fewshot": W.fewshot_trace(12, seed=3)}


@pytest.mark.parametrize("compact", [False, True])
def test_every_workload_round_trips_through_a_trace_file(tmp_path, compact):
    for shape, tr in generated().items():
        path = TR.write(tmp_path / f"{shape}.jsonl", tr, max_tokens=5, compact=compact)
        back = TR.to_trace(TR.read(path, default_max_tokens=99))
        assert len(back) == len(tr)
        t0 = tr.requests[0].arrival_s
        for a, b in zip(tr.requests, back.requests):
            assert b.doc_ids == a.doc_ids and b.segments == a.segments and b.query == a.query, shape
            assert b.max_tokens == 5 and b.prompt_tokens == a.prompt_tokens
            assert abs(b.arrival_s - (a.arrival_s - t0)) <= 0.0005  # milliseconds since the first
        text = path.read_text()
        if compact:  # each segment's text once, however often it recurs
            n_unique = len({i for r in tr.requests for i in r.doc_ids})
            assert sum(x is not None for ln in text.splitlines() for x in json.loads(ln)["segments"]) == n_unique


def test_mooncake_fields_and_hash_ids_mark_shared_prefixes_only(tmp_path):
    rng = __import__("random").Random(4)
    a, b, c = (W.make_document(rng, i, 600) for i in range(3))
    q = ("<q>", "find", a.keys[0], "<a>")
    reqs = [W.Request(0, 0.0, [a.words, b.words], q, [0, 1]),
            W.Request(1, 0.25, [a.words, c.words], q, [0, 2]),
            W.Request(2, 1.5, [b.words, a.words], q, [1, 0])]
    path = TR.write(tmp_path / "t.jsonl", W.Trace("x", reqs), max_tokens=7)
    objs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [o["timestamp"] for o in objs] == [0, 250, 1500]
    assert [o["input_length"] for o in objs] == [1204] * 3 and all(o["output_length"] == 7 for o in objs)
    h = [o["hash_ids"] for o in objs]
    assert all(len(x) == 3 for x in h)  # ceil(1204 / 512) blocks, the last one partial
    assert h[0] == [0, 1, 2]                     # ids numbered in order of first appearance
    assert h[1][0] == h[0][0] and h[1][1:] == [3, 4]  # the first 512 tokens are a's in both
    assert set(h[2]).isdisjoint(h[0] + h[1])     # the same segments in another order: no prefix shared
    assert objs[2]["segment_ids"] == [1, 0]      # ... which the segment ids do show
    # a block's id is its whole prefix's: the same 512 tokens after another first block get another id
    x, y, z = (W.make_document(rng, i, 512).words for i in range(3, 6))
    hasher = TR.BlockHasher()
    assert hasher(x + y) == [0, 1] and hasher(z + y) == [2, 3] and hasher(x + y + z) == [0, 1, 4]


@pytest.mark.parametrize("line, says", [
    ('{"query": "x"}', "KeyError"),
    ('{"segments": [], "query": "x"}', "non-empty list"),
    ('{"segments": ["a"], "query": ""}', "query must be"),
    ('{"segments": [[1, "b"]], "query": "x"}', "segment 0 must be"),
    ('{"segments": ["a", "b"], "segment_ids": [1], "query": "x"}', "one per segment"),
    ('{"segments": [null], "segment_ids": [9], "query": "x"}', "null but"),
    ('{"segments": ["a"], "query": "x", "timestamp": -5}', "timestamp >= 0"),
    ('{"segments": ["a"], "query": "x", "output_length": 0}', "output_length must be"),
    ('[1, 2]', "JSON object"),
])
def test_a_malformed_line_is_refused_naming_it(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"segments": ["a b"], "segment_ids": [1], "query": "q"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{says}"):
        TR.read(path, 8)


def test_one_id_for_two_contents_and_an_empty_file_are_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"segments": ["a b"], "segment_ids": ["d"], "query": "q"}\n'
                    '{"segments": ["a c"], "segment_ids": ["d"], "query": "q"}\n')
    with pytest.raises(ValueError, match="t.jsonl:2: segment id 'd' names two different contents"):
        TR.read(path, 8)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        TR.read(path, 8)


def test_remote_reads_the_older_lines_and_token_ids(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"segments": ["a b", [5, 6, 7]], "query": [9], "max_tokens": 3, "arrival_s": 0.5}\n')
    (r,) = remote.load_trace(path, 8)
    assert (r.segments, r.query, r.max_tokens, r.arrival_s) == (["a b", [5, 6, 7]], [9], 3, 0.5)
    (q,) = TR.to_trace(TR.read(path, 8)).requests
    assert q.segments == [("a", "b"), (5, 6, 7)] and q.query == (9,) and len(set(q.doc_ids)) == 2


def test_arrivals_scaled_to_a_rate_keep_the_pattern():
    tr = TR.to_trace([TR.TraceLine(i, ["a"], "q", 4, t) for i, t in enumerate([0.0, 1.0, 1.5, 4.0])])
    fast = TR.at_rate(tr, 2.0, seed=1)
    assert [r.arrival_s for r in fast.requests] == pytest.approx([0.0, 0.5, 0.75, 2.0])  # 4 requests / 2 req/s
    untimed = TR.to_trace([TR.TraceLine(i, ["a"], "q", 4) for i in range(50)])
    poisson = [r.arrival_s for r in TR.at_rate(untimed, 5.0, seed=2).requests]
    assert poisson == sorted(poisson) and 5 < poisson[-1] < 20  # about 50 / 5 s


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_replays_a_trace_on_its_own_mesh_in_every_mode(tmp_path):
    """`bench.serve --trace` on a mesh of its own: every request of a tiny written trace answers
    in full, prefix and hypic, the ratios are taken, and the repeated segments hit in hypic."""
    from bench import serve

    path = tmp_path / "agent.jsonl"
    serve.main(["--workload", "agent", "--shapes", "agent", "--n-agent", "6", "--trace-rate", "4",
                "--max-tokens", "2", "--write-trace", str(path)])
    out = serve.main(["--trace", str(path), "--no-cold", "--no-plots", "--modes", "full", "prefix", "hypic",
                      "--rates-x", "1.0", "--host-bytes", "4MiB", "--out", str(tmp_path)])
    closed = out["closed"]["trace"]["modes"]
    assert set(closed) == {"full", "prefix", "hypic"}
    for mode, s in closed.items():
        assert s["n"] == 6 and s["errors"] == 0, (mode, s["errors_sample"])
    # no warm-up: the first requests build their segments; a session's tools recur in its later turns
    assert closed["hypic"]["hit_rate"] > 0.3 and closed["hypic"]["records"][-1]["hits"] > 0
    assert out["shape"] == "trace" and out["headline"]["vs_best_baseline"]["ttft_p50"]["ratio"] > 0
    assert {m: len(d["points"]) >= 1 for m, d in out["sweep"]["modes"].items()} == {
        "full": True, "prefix": True, "hypic": True}
    assert json.loads((tmp_path / "serve_trace.json").read_text())["shape"] == "trace"
    assert Path(path).read_text().count("\n") == 6
