"""The five serving workloads of bench/workloads.py (RAG, summarization, agent, chat, few-shot):
shapes, determinism from integer seeds, and the segment reuse each is meant to exercise. Fast,
no mesh, no model."""
from __future__ import annotations

from collections import Counter

import pytest

from bench import workloads as W
from bench.quality import tasks as T


def five(n: int, seed: int) -> dict[str, W.Trace]:
    corpus = W.make_corpus(60, (128, 1024), seed=1)
    pool = W.make_corpus(10, (768, 2048), seed=2, first_id=100_000)
    return {
        "rag": W.rag_trace(corpus, n, seed=seed, max_prompt_tokens=4096),
        "summarization": W.summarization_trace(pool, n, seed=seed),
        "agent": W.agent_trace(n, seed=seed),
        "chat": W.chat_trace(n, seed=seed),
        "fewshot": W.fewshot_trace(n, seed=seed),
    }


def key(tr: W.Trace) -> list:
    return [(r.arrival_s, r.doc_ids, r.segments, r.query, r.k_drawn, r.shape) for r in tr.requests]


def reuse_fraction(tr: W.Trace) -> float:
    """Segment occurrences whose segment (same id, same words) appeared in an earlier request."""
    seen: dict = {}
    reused = total = 0
    for r in tr.requests:
        for i, words in zip(r.doc_ids, r.segments):
            total += 1
            if i in seen:
                assert seen[i] == words, f"segment id {i} with two contents"
                reused += 1
        for i, words in zip(r.doc_ids, r.segments):
            seen[i] = words
    return reused / total


def test_every_workload_is_deterministic_from_its_seeds():
    a, b, c = five(24, seed=5), five(24, seed=5), five(24, seed=6)
    for shape in a:
        assert key(a[shape]) == key(b[shape]), shape
        assert key(a[shape]) != key(c[shape]), shape
    timed = W.chat_trace(10, seed=3, rate=2.0), W.fewshot_trace(10, seed=3, rate=2.0)
    assert all(0 < r.arrival_s for t in timed for r in t.requests)
    assert key(timed[0]) == key(W.chat_trace(10, seed=3, rate=2.0))


def test_every_workload_reuses_segments_in_the_tasks_language():
    words = set(T.WORDS)
    for shape, tr in five(40, seed=7).items():
        assert len(tr) == 40 and all(r.shape == shape for r in tr.requests)
        for r in tr.requests:
            assert r.segments and len(r.segments) == len(r.doc_ids)
            assert len(set(r.doc_ids)) == len(r.doc_ids), (shape, r.doc_ids)  # no segment twice
            assert all(set(s) <= words for s in r.segments)
            assert r.query[0] == "<q>" and r.query[-1] == "<a>"
        # a reuse workload: a good part of what is sent was sent before
        assert reuse_fraction(tr) > 0.3, (shape, reuse_fraction(tr))


def test_agent_tools_are_reused_in_many_orders():
    a = W.agent_trace(40, seed=4, n_sessions=6)
    orders = {tuple(d for d in r.doc_ids if d < 10000) for r in a.requests}
    assert len(orders) == 6  # one per session
    shared = Counter(t for o in orders for t in set(o))
    tool = max(shared, key=shared.get)
    assert shared[tool] >= 2
    # the most shared tool sits at different positions in different sessions' prompts
    assert len({o.index(tool) for o in orders if tool in o}) >= 2


def test_chat_system_prompt_then_earlier_turns_in_order_with_a_window():
    c = W.chat_trace(60, seed=8, n_sessions=3, turn_window=4)
    by_session: dict[int, list[list[int]]] = {}
    for r in c.requests:
        sys_id, turns = r.doc_ids[0], r.doc_ids[1:]
        assert 30000 <= sys_id < 40000 and all(t >= 40000 for t in turns)
        assert turns == sorted(turns) and len(turns) <= 4
        if turns:
            assert len({(t - 40000) // 1000 for t in turns}) == 1  # one session's turns
            by_session.setdefault((turns[0] - 40000) // 1000, []).append(turns)
    for prompts in by_session.values():
        # each turn adds the previous one; once past the window the oldest drops out (the
        # prefix changes while the rest of the segments stay)
        assert any(len(p) == 4 for p in prompts)
        longest = [p for p in prompts if len(p) == 4]
        assert len({p[0] for p in longest}) > 1
    assert len({r.doc_ids[0] for r in c.requests}) <= 3  # system prompts from a small pool


def test_fewshot_examples_come_from_the_tasks_pool_in_random_orders():
    f = W.fewshot_trace(80, seed=9, n_tasks=3, examples_pool=20, k=(4, 8))
    positions: dict[int, set[int]] = {}
    for r in f.requests:
        task = r.doc_ids[0] - 50000
        assert 0 <= task < 3 and 4 <= r.k_drawn <= 8 and len(r.doc_ids) == r.k_drawn + 1
        assert all(60000 + 1000 * task <= e < 60000 + 1000 * task + 20 for e in r.doc_ids[1:])
        for pos, e in enumerate(r.doc_ids[1:]):
            positions.setdefault(e, set()).add(pos)
    # popular examples recur at several positions (the same example in other orders)
    assert sum(1 for p in positions.values() if len(p) >= 3) >= 5


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_new_workloads_refuse_a_bad_rate(rate):
    with pytest.raises(ValueError):
        W.chat_trace(3, seed=1, rate=rate)
    with pytest.raises(ValueError):
        W.fewshot_trace(3, seed=1, rate=rate)
