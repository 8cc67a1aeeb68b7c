"""The span task (a fact split over a document boundary, issue 26) and the evaluation's statistics:
the prompts of the older tasks are those the published numbers were measured on, span prompts
and training sequences say what tasks.py says, and the 95% intervals match plain references."""
from __future__ import annotations

import hashlib
import math
import random

import pytest

from bench.quality import eval as E
from bench.quality import tasks as T

# sha256 over the first 20 evaluation prompts of the four older tasks and 20 training sequences
# with their mix, computed with tasks.py before the span task existed: adding it must not move them
OLD_EVAL_PROMPTS = "727946abc3db83b8beae32a2ea280b72f96780909ffea8459d39cc58e1d47120"
OLD_TRAIN_SEQUENCES = "ce9b6475c0a05ecf93f14a61eae14cba43ab0d08f328bbe798f9e6f1c817b72a"
OLD_MIX = {"retrieval": 0.3, "two_hop": 0.2, "aggregation": 0.25, "update": 0.25}


def test_older_tasks_prompts_are_unchanged():
    h = hashlib.sha256()
    for task in ("retrieval", "two_hop", "aggregation", "update"):
        for i in range(20):
            world, q = T.eval_prompt(task, i)
            h.update(repr((world.docs, q.words, q.answer)).encode())
            assert not world.spans
    assert h.hexdigest() == OLD_EVAL_PROMPTS
    h = hashlib.sha256()
    for i in range(20):
        h.update(repr(T.train_sequence(random.Random(i), 8, (20, 40), mix=OLD_MIX)).encode())
    assert h.hexdigest() == OLD_TRAIN_SEQUENCES


def test_span_prompts_split_the_asked_fact_over_a_boundary():
    n_spans = set()
    for i in range(200):
        world, q = T.eval_prompt("span", i)
        key = q.words[2]
        assert q.words == ["<q>", "find", key, "<a>"] and key in world.spans
        n_spans.add(len(world.spans))
        for k, d in world.spans.items():
            # the key closes document d, its value (and the full stop) opens document d + 1, beyond
            # the convolution's reach from the key
            assert world.docs[d][-1] == k
            assert world.docs[d + 1][:5] == ["<doc>", *T.SPAN_OPENING, world.facts[k], "."]
            # stated nowhere else: only the boundary pairs the key with its value
            assert sum(doc.count(k) for doc in world.docs) == 1
        assert q.answer == [world.facts[key]]
        assert all(doc[0] == "<doc>" and doc.count("<doc>") == 1 for doc in world.docs)
    assert n_spans == set(range(T.EVAL_SPANS[0], T.EVAL_SPANS[1] + 1))


def test_span_answers_are_not_given_away_by_position():
    """With 4-7 split facts a prompt has several documents opening with a value: answering with one of
    them (what a model can do without reading the previous document) is right ~1 time in 5."""
    hits = []
    for i in range(300):
        world, q = T.eval_prompt("span", i)
        openers = [world.docs[d + 1][1 + len(T.SPAN_OPENING)] for d in world.spans.values()]
        hits.append(openers.count(q.answer[0]) / len(openers))
    assert 0.12 < sum(hits) / len(hits) < 0.3


def test_training_sequences_answer_span_queries_with_the_value_after_the_boundary():
    mix = {"retrieval": 0.2, "two_hop": 0.1, "aggregation": 0.15, "update": 0.15, "span": 0.4}
    n_span = 0
    for i in range(60):
        rng = random.Random(i)
        words, targets = T.train_sequence(rng, rng.randint(6, 12), (25, 54), mix=mix)
        docs_end = words.index("<q>")
        for pos, answer, task in targets:
            if task != "span":
                continue
            key = words[pos - 1]
            at = words.index(key)
            assert at < docs_end and words[at + 1: at + 6] == ["<doc>", *T.SPAN_OPENING, answer, "."], (i, key)
            n_span += 1
    assert n_span > 200


def _wilson_reference(k: int, n: int, z: float = E.Z95, grid: int = 200_000) -> tuple[float, float]:
    """The Wilson interval by its definition: every p whose score test |k/n - p| / sqrt(p(1-p)/n) <= z
    does not reject, found on a fine grid."""
    inside = [i / grid for i in range(grid + 1)
              if abs(k / n - i / grid) <= z * math.sqrt((i / grid) * (1 - i / grid) / n) or (i / grid) == k / n]
    return 100.0 * min(inside), 100.0 * max(inside)


@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (3, 17), (250, 500), (493, 500), (1, 500)])
def test_wilson_matches_the_score_test_inversion(k, n):
    lo, hi = E.wilson(k, n)
    ref_lo, ref_hi = _wilson_reference(k, n)
    assert lo == pytest.approx(ref_lo, abs=2e-3) and hi == pytest.approx(ref_hi, abs=2e-3)
    assert lo <= 100.0 * k / n <= hi


def test_wilson_on_random_counts_contains_the_estimate_and_narrows_with_n():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 2000)
        k = rng.randint(0, n)
        lo, hi = E.wilson(k, n)
        assert 0.0 <= lo <= 100.0 * k / n <= hi <= 100.0
        lo4, hi4 = E.wilson(4 * k, 4 * n)
        assert hi4 - lo4 < hi - lo


def test_mean_interval_is_the_normal_interval_of_the_mean():
    xs = [0.5, 1.0, 1.0, 0.75, 0.25, 1.0]
    m, lo, hi = E.mean_interval(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    assert m == pytest.approx(sum(xs) / len(xs))
    assert hi - m == pytest.approx(m - lo) == pytest.approx(E.Z95 * sd / len(xs) ** 0.5)
    assert E.mean_interval([1.0] * 5) == (1.0, 1.0, 1.0)


def test_intervals_count_the_correctness_strings():
    got = E.intervals({"retrieval": {"full": "1101", "hypic_w0": "0000"}})
    assert got == {"retrieval": {"full": list(E.wilson(3, 4)), "hypic_w0": [0.0, E.wilson(0, 4)[1]]}}


def test_training_span_prompts_have_decoy_openings_and_no_repeated_query():
    """Every boundary of a training prompt with span queries opens with SPAN_OPENING and a value, so
    the values opening documents are not the span answers (elimination among them answered 70% of
    training span queries and 25-32% held out); no query is asked twice (copying a repeat's answer)."""
    mix = {"retrieval": 0.2, "two_hop": 0.1, "aggregation": 0.15, "update": 0.15, "span": 0.4}
    decoys = spans = 0
    for i in range(60):
        rng = random.Random(1000 + i)
        words, targets = T.train_sequence(rng, rng.randint(6, 12), (25, 54), mix=mix)
        docs_end = words.index("<q>")
        starts = [j for j, w in enumerate(words[:docs_end]) if w == "<doc>"]
        for j in starts[1:]:
            assert words[j + 1: j + 3] == T.SPAN_OPENING and words[j + 3] in T.VALUES and words[j + 4] == ".", (i, j)
            if words[j - 1] in T.KEYS:
                spans += 1
            else:
                decoys += 1
        queries = [tuple(words[j: j + 4]) for j, w in enumerate(words) if w == "<q>"]
        assert len(queries) == len(set(queries)), i
    assert spans > 100 and decoys > 100
