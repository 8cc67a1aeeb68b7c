"""bench.quality.train's options for a stage of its own: --docs/--filler train at one level of
their own, every batch drawn at it."""
from __future__ import annotations

import random

import pytest

from bench.quality import tasks as T
from bench.quality import train


def test_docs_and_filler_make_one_level_that_every_step_uses():
    args = train.parse_args(["--docs", "6", "10", "--filler", "0", "8", "--mix", "span=0.6", "retrieval=0.4"])
    cur = train.curriculum(args)
    assert cur.levels == (((6, 10), (0, 8)),)
    for step in (0, 399, 1500):  # never forced past it, whatever the step
        assert cur.level(0, step / 500) == 0
    mix = train.task_mix(args)
    rng = random.Random(5)
    docs = []
    for _ in range(30):
        n_docs, filler = cur.sample(rng, 0)
        words, targets = T.train_sequence(rng, n_docs, filler, mix=mix)
        docs.append(words.count("<doc>"))
        assert {t for _, _, t in targets} <= {"span", "retrieval"}
    assert min(docs) >= 6 and max(docs) <= 10 and len(set(docs)) > 1


def test_default_is_the_curriculum():
    assert train.curriculum(train.parse_args([])).levels == T.Curriculum().levels


@pytest.mark.parametrize("argv", [["--docs", "6", "10"], ["--filler", "0", "8"]])
def test_docs_and_filler_go_together(argv, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert "--docs and --filler go together" in capsys.readouterr().err
