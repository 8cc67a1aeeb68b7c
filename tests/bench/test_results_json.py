"""bench/results_json.dumps: any result round-trips through it unchanged, records come one to a
line and lists of numbers on one line, and values json cannot encode go through `default`."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from bench import results_json
from bench.driver import json_default


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["num", "str", "none", "bool", "list", "dict", "records"] if depth < 4 else ["num", "str"])
    if kind == "num":
        return rng.choice([rng.randint(-5, 10**6), rng.uniform(-1e3, 1e3), float("inf")])
    if kind == "str":
        return rng.choice(["", "a\nb", "ü \"q\"", "x" * rng.randint(1, 9)])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "records":
        return [dict(i=i, t=rng.random(), tiers={"host": rng.randint(0, 3)}, e=[1, 2]) for i in range(rng.randint(1, 5))]
    return {f"k{j}": random_value(rng, depth + 1) for j in range(rng.randint(0, 4))}


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_any_result_round_trips(seed):
    rng = random.Random(seed)
    for _ in range(50):
        x = {"top": random_value(rng)}
        assert json.loads(results_json.dumps(x)) == json.loads(json.dumps(x)), seed


def test_records_are_one_a_line_and_numbers_on_one_line():
    recs = [dict(i=i, ttft_s=0.1 * i, tiers={"disk": i}) for i in range(3)]
    text = results_json.dumps(dict(n=3, ttft_s=[0.1, 0.2, 0.3], records=recs, nested=dict(a=[dict(b=[dict(c=1)])])))
    lines = text.splitlines()
    assert ' "ttft_s": [0.1, 0.2, 0.3],' in lines
    assert [ln.strip().rstrip(",") for ln in lines if ln.strip().startswith('{"i"')] == [json.dumps(r) for r in recs]
    assert json.loads(text)["nested"] == dict(a=[dict(b=[dict(c=1)])])


def test_numpy_and_paths_go_through_default():
    text = results_json.dumps(dict(x=np.float32(0.5), p=Path("bench/results"), n=[np.int64(3)]), default=json_default)
    assert json.loads(text) == dict(x=0.5, p="bench/results", n=[3])
    with pytest.raises(TypeError):
        results_json.dumps(dict(x=np.float32(0.5)))
