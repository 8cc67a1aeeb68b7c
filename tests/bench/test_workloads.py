"""The serving benchmark's trace generators (bench/workloads.py) and the cold-path simulation
(bench/cold.py): fast, no mesh, no model."""
from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from bench import cold_model as C
from bench import workloads as W
from bench.quality import tasks as T


@pytest.fixture(scope="module")
def corpus():
    return W.make_corpus(120, (128, 2048), seed=11)


def test_documents_have_exact_lengths_in_range_and_the_tasks_language(corpus):
    words = set(T.WORDS)
    for d in corpus:
        assert 128 <= d.n_tokens <= 2048
        assert d.words[0] == "<doc>" and d.keys
        assert set(d.words) <= words
    for n in (8, 37, 128, 2048):
        assert W.make_document(random.Random(n), 0, n).n_tokens == n
    # log-uniform lengths: the median sits near the geometric mean sqrt(128 * 2048) = 512
    med = statistics.median(d.n_tokens for d in corpus)
    assert 300 < med < 900


def test_zipf_popularity_of_first_draws():
    n, s = 50, 1.0
    pop = W.Popularity(n, s, seed=3)
    rng = random.Random(4)
    draws = 20000
    first = Counter(pop.draw(rng, 1)[0] for _ in range(draws))
    w = W.zipf_weights(n, s)
    assert abs(sum(w) - 1) < 1e-12 and all(a > b for a, b in zip(w, w[1:]))
    for rank in (0, 1, 4, 19):
        item = pop.item_at[rank]
        assert abs(first[item] / draws - w[rank]) < 0.015, (rank, first[item] / draws, w[rank])
    # rank 1 about twice as often as rank 2, ten times as often as rank 10 (s = 1)
    f = lambda r: first[pop.item_at[r]]  # noqa: E731
    assert 1.6 < f(0) / f(1) < 2.5 and 6 < f(0) / f(9) < 15


def test_rag_requests_use_popular_documents_more(corpus):
    pop = W.Popularity(len(corpus), 1.0, seed=5)
    tr = W.rag_trace(corpus, 300, seed=6, popularity=pop)
    uses = Counter(d for r in tr.requests for d in r.doc_ids)
    top = sum(uses[pop.item_at[r]] for r in range(10))
    bottom = sum(uses[pop.item_at[r]] for r in range(len(corpus) - 10, len(corpus)))
    assert top > 3 * bottom


def test_rag_k_range_budget_distinct_and_random_order(corpus):
    tr = W.rag_trace(corpus, 200, seed=7, k=(4, 32), max_prompt_tokens=4096)
    ks = [r.k_drawn for r in tr.requests]
    assert min(ks) >= 4 and max(ks) <= 32 and len(set(ks)) > 15
    firsts = Counter()
    for r in tr.requests:
        assert 1 <= len(r.segments) <= r.k_drawn
        assert r.prompt_tokens <= 4096
        assert len(set(r.doc_ids)) == len(r.doc_ids)  # without replacement
        assert [corpus[i].words for i in r.doc_ids] == r.segments
        assert r.query[0] == "<q>" and r.query[-1] == "<a>"
        assert r.query[2] in {k for i in r.doc_ids for k in corpus[i].keys}
        firsts[r.doc_ids[0]] += 1
    # random order: the most popular document does not always lead
    assert max(firsts.values()) < 0.5 * len(tr.requests)
    # a large budget keeps every drawn document
    big = W.rag_trace(corpus, 50, seed=7, k=(4, 32), max_prompt_tokens=10 ** 9)
    assert all(len(r.segments) == r.k_drawn for r in big.requests)


def test_poisson_inter_arrival_mean_and_spread():
    rate = 4.0
    arr = W.poisson_arrivals(random.Random(8), rate, 20000)
    gaps = [b - a for a, b in zip([0.0] + arr, arr)]
    assert all(g > 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) < 0.02 / rate * 5
    cv = statistics.pstdev(gaps) / mean  # exponential: coefficient of variation 1
    assert 0.95 < cv < 1.05
    assert W.poisson_arrivals(random.Random(8), None, 5) == [0.0] * 5
    with pytest.raises(ValueError):
        W.poisson_arrivals(random.Random(8), 0.0, 3)


def test_traces_deterministic_with_a_seed(corpus):
    def key(tr):
        return [(r.arrival_s, r.doc_ids, r.query, r.k_drawn) for r in tr.requests]

    a = W.rag_trace(corpus, 30, seed=9, rate=2.0)
    b = W.rag_trace(corpus, 30, seed=9, rate=2.0)
    c = W.rag_trace(corpus, 30, seed=10, rate=2.0)
    assert key(a) == key(b) and key(a) != key(c)
    assert W.make_corpus(5, seed=1)[3].words == W.make_corpus(5, seed=1)[3].words
    s1 = W.summarization_trace(W.make_corpus(10, (768, 2048), seed=2), 8, seed=3)
    s2 = W.summarization_trace(W.make_corpus(10, (768, 2048), seed=2), 8, seed=3)
    assert key(s1) == key(s2)
    assert key(W.agent_trace(12, seed=4)) == key(W.agent_trace(12, seed=4))


def test_summarization_and_agent_shapes():
    pool = W.make_corpus(12, (768, 2048), seed=2)
    s = W.summarization_trace(pool, 20, seed=3, max_prompt_tokens=4096)
    assert all(1 <= len(r.segments) <= 4 and r.prompt_tokens <= 4096 for r in s.requests)
    assert statistics.fmean(len(sg) for r in s.requests for sg in r.segments) > 768
    a = W.agent_trace(24, seed=4, n_sessions=3)
    seg_lens = [len(sg) for r in a.requests for sg in r.segments]
    assert max(seg_lens) <= 256 and statistics.fmean(len(r.segments) for r in a.requests) > 8
    # earlier turns come back as segments, in order, after the tools and memory files
    by_session: dict[tuple, list] = {}
    for r in a.requests:
        tools = tuple(d for d in r.doc_ids if d < 10000)
        turns = [d for d in r.doc_ids if d >= 20000]
        assert turns == sorted(turns)
        by_session.setdefault(tools, []).append(len(turns))
    assert len(by_session) == 3 and all(max(v) > 0 for v in by_session.values())


def test_skewed_lengths_and_partitionings():
    L = W.skewed_lengths(32768, seed=1, lo=128, hi=4096)
    assert sum(L) == 32768 and min(L) >= 128 and max(L) <= 4096 + 128
    cost = C.fit_cost_model([(n, 1e-4 * n) for n in (128, 512, 1024, 2048)])
    for m in (1, 2, 4, 8):
        for how in C.PARTITIONS:
            w = C.partition(L, m, how, cost)
            assert len(w) == len(L) and set(w) <= set(range(m))
    assert C.partition([5] * 7, 3, "contiguous", cost) == [0, 0, 0, 1, 1, 2, 2]
    assert C.partition([5] * 4, 3, "round_robin", cost) == [0, 1, 2, 0]
    # one long segment and many short ones: LPT gives the long one a worker of its own
    skew = [3000] + [200] * 12
    lpt = C.partition(skew, 2, "lpt", cost)
    assert lpt.count(lpt[0]) == 1
    flat = lambda n: 0.0  # noqa: E731
    r = {how: C.simulate(skew, 2, how, cost, flat, 0.0) for how in C.PARTITIONS}
    assert r["lpt"].makespan_s <= min(r["round_robin"].makespan_s, r["contiguous"].makespan_s)
    one = C.simulate(skew, 1, "lpt", cost, flat, 0.0)
    assert one.makespan_s == pytest.approx(sum(cost.predict(n) for n in skew))
    rows = C.simulate_table(L, [1, 2, 4, 8], cost, lambda n: 0.01, 0.05, 0.1)
    by = {(x["partition"], x["m"]): x for x in rows}
    assert by[("lpt", 1)]["speedup_vs_m1"] == pytest.approx(1.0)
    assert by[("lpt", 8)]["speedup_vs_m1"] >= by[("round_robin", 8)]["speedup_vs_m1"] - 1e-9


def test_qps_at_slo_interpolation():
    from bench.driver import qps_at_slo

    pts = [dict(rate=1.0, ttft_p90_s=0.5), dict(rate=2.0, ttft_p90_s=0.9), dict(rate=3.0, ttft_p90_s=1.9)]
    q = qps_at_slo(pts, 1.4, unloaded_p90_s=0.3)
    assert q["measured_qps"] == 2.0 and q["interpolated_qps"] == pytest.approx(2.5) and not q["lower_bound"]
    # the first rate already misses: interpolate from the closed-loop p90 at rate 0
    q = qps_at_slo([dict(rate=1.0, ttft_p90_s=2.0)], 1.0, unloaded_p90_s=0.5)
    assert q["measured_qps"] == 0.0 and q["interpolated_qps"] == pytest.approx(1 / 3)
    assert qps_at_slo([dict(rate=1.0, ttft_p90_s=2.0)], 1.0, unloaded_p90_s=1.5)["interpolated_qps"] == 0.0
    q = qps_at_slo(pts[:2], 5.0, unloaded_p90_s=0.3)
    assert q["lower_bound"] and q["interpolated_qps"] == 2.0


def test_prefix_replay_counts_segment_aligned_prefixes(tmp_path):
    import json

    from bench.driver import Encoder, PrefixReplay

    (tmp_path / "config.json").write_text(json.dumps(dict(
        vocab_size=512, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)))
    enc = Encoder(tmp_path)
    assert not enc.text and enc.state_bytes(10) > enc.state_bytes(0) > 0
    rp = PrefixReplay(enc, 1 << 30)
    seg = lambda n: ("<doc>",) * n  # noqa: E731

    def req(ids):
        return W.Request(0, 0.0, [seg(10) for _ in ids], ("<q>",), list(ids))

    assert rp.request("rag", req([1, 2, 3])) == 0
    assert rp.request("rag", req([1, 2, 4])) == 2
    assert rp.request("rag", req([2, 1, 3])) == 0      # another order: no prefix
    assert rp.request("agent", req([1, 2, 3])) == 0    # another shape's content
    assert rp.request("rag", req([1, 2, 3, 5])) == 3
    small = PrefixReplay(enc, enc.state_bytes(25))     # room for about one state: LRU evicts
    small.request("rag", req([1, 2, 3]))
    assert small.request("rag", req([1, 9])) == 0


def test_combine_in_runs_against_in_order(fresh_seed):
    """The simulated combine policies (bench/cold.py): with a pass costing exactly its segments'
    in-order costs the two agree; with a fixed cost per pass, runs finish no later; runs cover
    the prompt in order."""
    import random

    rng = random.Random(fresh_seed)
    for _ in range(200):
        n = rng.randint(1, 20)
        arrival = [rng.uniform(0, 1) for _ in range(n)]
        lengths = [rng.randint(1, 100) for _ in range(n)]
        per = {L: rng.uniform(0.001, 0.05) for L in lengths}
        in_order = C.combine_in_order(lengths, arrival, lambda L: per[L])
        # a run composed at once but charged per segment: the same finish (segments that were
        # in before the run began are composed back to back either way)
        t, runs = C.combine_in_runs(arrival, lambda r: sum(per[lengths[i]] for i in r))
        assert sum(runs) == n and all(k >= 1 for k in runs)
        assert t <= in_order + 1e-9
        fixed = C.combine_in_runs(arrival, lambda r: 0.02 + 0.001 * len(r))[0]
        assert fixed <= C.combine_in_order(lengths, arrival, lambda L: 0.021) + 1e-9
    # all in at once: one run
    assert C.combine_in_runs([0.0] * 5, lambda r: 1.0) == (1.0, [5])
    assert C.combine_in_runs([0.3, 0.1, 0.2], lambda r: 0.0) == (0.3, [3])
