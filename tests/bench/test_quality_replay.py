"""The published quality table cannot drift from the code: re-run the first prompts of every task
through the engine and compare with the committed bench/quality/results/quality.json.

Exact, not statistical: every replayed prediction must equal the stored one, except where the
stored top-1/top-2 logit margin is a near-tie (< NEAR_TIE), which another float summation order
may legitimately flip.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "hypic-tiny-qwen35"
RESULTS = ROOT / "bench" / "quality" / "results" / "quality.json"
N_REPLAY = 50
REPLAY_MODES = ("full", "additive", "hypic_w8")
NEAR_TIE = 1e-3

pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").exists() or not RESULTS.exists(),
    reason="bundled model or quality.json missing",
)


@pytest.fixture(scope="module")
def published():
    from bench import results_json

    return results_json.load(RESULTS)  # written when the additive ablation was called "naive"


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_generator_is_deterministic_and_matches_the_tokenizer():
    from transformers import AutoTokenizer

    from bench.quality import tasks as T

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    ids = T.word_ids(tok)
    assert len(tok) == len(T.WORDS) == json.loads((MODEL / "config.json").read_text())["vocab_size"]
    for task in T.TASKS:
        w1, q1 = T.eval_prompt(task, 3)
        w2, q2 = T.eval_prompt(task, 3)
        assert w1.docs == w2.docs and q1 == q2
        assert len(w1.docs) == T.EVAL_DOCS and all(d[0] == "<doc>" for d in w1.docs)
        assert 350 <= w1.n_tokens <= 560
        text_ids = tok(" ".join(w1.docs[0]), add_special_tokens=False)["input_ids"]
        assert text_ids == [ids[w] for w in w1.docs[0]]
    # held-out prompts differ from one another
    assert T.eval_prompt("retrieval", 0)[0].docs != T.eval_prompt("retrieval", 1)[0].docs


def test_update_prompts_restate_the_asked_key_later():
    from bench.quality import tasks as T

    n_restated = set()
    for i in range(200):
        world, q = T.eval_prompt("update", i)
        key = q.words[2]
        assert q.words == ["<q>", "find", key, "<a>"]
        hist = world.history[key]
        docs = [d for d, _ in hist]
        values = [v for _, v in hist]
        n_restated.add(len(hist))
        # stated first in one document, then restated in strictly later ones, each time with a new value
        assert len(hist) >= 2 and docs == sorted(set(docs)) and len(set(values)) == len(values)
        assert q.answer == [values[-1]] == [world.facts[key]]
        for d, doc in enumerate(world.docs):
            stated = [doc[j + 1] for j in range(len(doc) - 2) if doc[j] == key and doc[j + 2] == "."]
            assert stated == ([values[docs.index(d)]] if d in docs else []), (i, d)
    assert n_restated == {2, 3}
    # the other tasks' prompts restate nothing, so their answers are the only statement of the key
    for task in ("retrieval", "two_hop", "aggregation"):
        assert all(not T.eval_prompt(task, i)[0].history for i in range(50))


def test_published_json_is_consistent(published):
    from bench.quality.eval import load_engine

    assert published["fingerprint"] == load_engine(MODEL).fingerprint, "quality.json was computed for other weights"
    assert published["n_per_task"] >= 500
    # the prefix-cache column reused half of every prompt's documents (not a recompute in disguise)
    half = published["docs_per_prompt"] // 2
    assert published["prefix_reused_segments"] == {"mean": half, "min": half, "max": half}
    for task in published["tasks"]:
        for mode in published["modes"]:
            bits = published["correct"][task][mode]
            assert len(bits) == published["n_per_task"]
            assert published["accuracy"][task][mode] == pytest.approx(100.0 * bits.count("1") / len(bits))


def test_readme_is_generated_from_the_json():
    from bench.quality.readme import DEFAULT_RESULTS, render

    assert (MODEL / "README.md").read_text() == render(MODEL, DEFAULT_RESULTS)


@pytest.mark.slow  # every task's first prompts through the bundled model: minutes on 2 cores
@pytest.mark.timeout(900)
def test_replay_matches_published(published, one_thread):
    from bench.quality import eval as E

    engine = E.load_engine(MODEL)
    order = published.get("order", "layer")
    mismatches, near_ties = [], 0
    for task in published["tasks"]:
        for i in range(N_REPLAY):
            segments, query, answer = E.prompt_ids(engine, task, i)
            res = E.run_prompt(engine, segments, query, answer, REPLAY_MODES, order)
            for mode in REPLAY_MODES:
                want = published["detail"][task][mode][i]
                ok_bit = published["correct"][task][mode][i] == "1"
                got = res[mode]
                if got["pred"] == want["pred"] and got["ok"] == ok_bit:
                    continue
                if want["margin"] < NEAR_TIE or got["margin"] < NEAR_TIE:
                    near_ties += 1
                    continue
                mismatches.append((task, i, mode, want, got))
    assert not mismatches, f"{len(mismatches)} replayed predictions differ from quality.json: {mismatches[:5]}"
    assert near_ties <= 3, f"{near_ties} near-tie flips"


def test_training_prompts_answer_find_with_the_last_statement():
    """With update queries in the mix, every `find` in a training prompt (retrieval or update) is
    answered with the value of the key's last statement, at every curriculum level."""
    import random

    from bench.quality import tasks as T

    cur = T.Curriculum()
    mix = {"retrieval": 0.25, "two_hop": 0.25, "aggregation": 0.25, "update": 0.25}
    n_restated_asked = 0
    for level in range(len(cur.levels)):
        for i in range(40):
            rng = random.Random(1000 * level + i)
            n_docs, filler = cur.sample(rng, level)
            words, targets = T.train_sequence(rng, n_docs, filler, mix=mix)
            docs_end = words.index("<q>")
            last: dict[str, str] = {}
            count: dict[str, int] = {}
            for j in range(docs_end - 2):
                if words[j + 2] == "." and words[j] in T.KEYS:
                    last[words[j]] = words[j + 1]
                    count[words[j]] = count.get(words[j], 0) + 1
            for pos, answer, task in targets:
                if words[pos - 2] == "find":
                    key = words[pos - 1]
                    assert answer == last[key], (level, i, key)
                    n_restated_asked += count[key] > 1
                    assert task != "update" or count[key] > 1
    assert n_restated_asked > 100
