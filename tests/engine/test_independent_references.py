"""Properties that hand-made mutants showed unguarded (issue #20), checked against an independent
computation rather than against a second path that shares the code under test:

- re-rotation: a mixer's keys computed at positions p.. and re-rotated by d equal its keys
  computed directly at p+d.. (per model family: partial rotary, no rotary, MLA without rope);
  end to end, in a model whose first layer is full attention (its keys depend only on the
  embeddings and the positions), layer 0's keys after a hypic prefill of several segments equal
  those of a full prefill;
- decode: the logits after decoding t equal those of prefilling the prompt plus t, token after
  token (so a decode that drops a layer's state update shows at the next step).
"""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from tests.support.tiny import PIC_CONFIGS, save_tiny

FAMILIES = sorted(PIC_CONFIGS)
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, HybridEngine]:
    base = tmp_path_factory.mktemp("guards")
    return {f: HybridEngine.from_pretrained(save_tiny(f, base / f, seed=11, **PIC_CONFIGS[f]),
                                            load_tokenizer=False) for f in FAMILIES}


def attention_mixers(engine: HybridEngine) -> list[torch.nn.Module]:
    mixers = [m for m in engine.model.modules() if hasattr(m, "rerotate") and hasattr(m, "qkv")]
    assert mixers, "no attention mixer found"
    return mixers


def keys_at(mixer: torch.nn.Module, x: torch.Tensor, start: int) -> torch.Tensor:
    """The mixer's keys for hidden states x [1, T, D] placed at positions start..start+T-1."""
    positions = torch.arange(start, start + x.shape[1])
    try:
        return mixer.qkv(x, positions)[1]
    except TypeError:  # Kimi's MLA: no positions at all (no rope on its keys)
        return mixer.qkv(x)[1]


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_rerotated_keys_equal_keys_computed_at_the_new_positions(engines, family, fresh_seed) -> None:
    engine = engines[family]
    g = torch.Generator().manual_seed(fresh_seed)
    hidden = engine.model.embed_tokens.weight.shape[1]
    for mixer in attention_mixers(engine):
        x = torch.randn(1, 9, getattr(mixer, "input_size", hidden), generator=g)
        for p, d in ((0, 1), (0, 37), (5, 200), (13, 1)):
            direct = keys_at(mixer, x, p + d)
            moved = mixer.rerotate(keys_at(mixer, x, p), d)
            err = float((moved - direct).abs().max())
            assert err < TOL, (family, p, d, err)
        rotary = getattr(mixer, "rotary", None)
        if rotary is not None:  # and the keys do depend on the position: the check can fail
            assert float((keys_at(mixer, x, 0) - keys_at(mixer, x, 1)).abs().max()) > 1e-3


@pytest.fixture(scope="module")
def full_first(tmp_path_factory) -> HybridEngine:
    cfg = dict(PIC_CONFIGS["qwen3_5_text"],
               layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"])
    path = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("full-first"), seed=12, **cfg)
    return HybridEngine.from_pretrained(path, load_tokenizer=False)


@torch.inference_mode()
def test_layer0_keys_after_hypic_prefill_equal_a_full_prefill(full_first, fresh_seed) -> None:
    engine = full_first
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (17, 5, 30, 11)]
    query = torch.randint(0, 512, (4,), generator=g).tolist()
    for seam in (0, 4):
        hypic = engine.prefill_segments(segs, query, mode="hypic", seam=seam).state.layers[0].keys
        full = engine.prefill([t for s in segs for t in s] + query).state.layers[0].keys
        assert hypic.shape == full.shape
        err = float((hypic - full).abs().max())
        assert err < TOL, (seam, err)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_decode_logits_equal_prefill_of_the_longer_prompt(engines, family, fresh_seed) -> None:
    engine = engines[family]
    g = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(0, 512, (21,), generator=g).tolist()
    steps = torch.randint(0, 512, (4,), generator=g).tolist()
    state = engine.prefill(prompt).state
    seen = list(prompt)
    for t in steps:
        logits, state = engine.decode_step(t, state)
        seen.append(t)
        want = engine.prefill(seen).logits
        err = float((logits - want).abs().max())
        assert err < TOL, (family, len(seen), err)


def test_segment_key_separates_every_input_and_is_stable(fresh_seed) -> None:
    """A key names exactly one entry: fingerprint, seam, dtype and the token ids (their order and
    count) all enter it; and it is a stable content address (a cache written by one version is
    found by the next), pinned by a known answer."""
    from common.engine.fingerprint import segment_key

    g = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, 512, (12,), generator=g).tolist()
    base = ("fp-a", 8, "float32", ids)
    variants = [base, ("fp-b", 8, "float32", ids), ("fp-a", 0, "float32", ids),
                ("fp-a", 9, "float32", ids), ("fp-a", 8, "bfloat16", ids),
                ("fp-a", 8, "float32", ids[:-1]), ("fp-a", 8, "float32", ids[::-1]),
                ("fp-a", 8, "float32", ids[:-1] + [(ids[-1] + 1) % 512])]
    keys = [segment_key(*v) for v in variants]
    assert len(set(keys)) == len(keys), keys
    assert segment_key(*base) == keys[0]
    assert segment_key("fp-golden", 8, "float32", [1, 2, 3, 500]) == "bbf3a66d1344e99cbc6e6e7cf2b4c76289b83ca3"


def test_planner_places_one_requests_misses_longest_first(fresh_seed) -> None:
    """The router's planner places a request's misses as LPT does (longest first onto the least
    loaded worker): on random skewed lengths its makespan equals lpt()'s, and on a case where
    shortest-first is worse, it is strictly better than that."""
    import random

    from services.router.planner import CostModel, Job, Planner, lpt, makespan

    def planned(tokens: list[int], n_workers: int) -> tuple[list[int], list[float]]:
        p = Planner(n_workers, CostModel((0.0, 1e-3, 0.0)))  # cost = tokens / 1000
        t = p.assign([Job(i, f"k{i}", n) for i, n in enumerate(tokens)])
        return [a.worker for a in t.assignments], [n / 1000 for n in tokens]

    workers, costs = planned([100, 100, 100, 300], 2)
    assert math.isclose(makespan(costs, workers, 2), 0.3)  # shortest-first would give 0.4
    g = random.Random(fresh_seed)
    for _ in range(20):
        n_workers = g.randrange(2, 5)
        tokens = [int(g.paretovariate(1.2) * 50) + 1 for _ in range(g.randrange(3, 12))]
        workers, costs = planned(tokens, n_workers)
        want = makespan(costs, lpt(costs, n_workers), n_workers)
        assert math.isclose(makespan(costs, workers, n_workers), want), (tokens, workers)
