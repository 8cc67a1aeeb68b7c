"""Composition of arrived runs (common.engine.pic.reuse.compose_run, common.engine.pic.runs) against the plain
reference, segment by segment in prompt order (prefill_segment_major), on every architecture the
engine serves: random odd segment sizes, random seam widths, random arrival orders."""
import random

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.reuse import compose_run, prefill_segment_major
from common.engine.pic.seam_plan import ARENAS, without_arenas
from common.engine.pic.runs import arrived_run, runs_as_arriving
from common.engine.state import AttentionLayerState, LinearLayerState
from tests.support.tiny import PIC_CONFIGS, save_tiny


@pytest.fixture(scope="module", params=sorted(PIC_CONFIGS))
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=23, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def state_rel(a, b) -> float:
    """Largest relative error over every tensor of two model states (same layout required)."""
    assert a.seq_len == b.seq_len and len(a.layers) == len(b.layers)
    worst = 0.0
    for x, y in zip(a.layers, b.layers):
        assert type(x) is type(y)
        if isinstance(x, LinearLayerState):
            worst = max(worst, rel(x.recurrent, y.recurrent))
            assert (x.conv is None) == (y.conv is None)
            if x.conv is not None:
                worst = max(worst, rel(x.conv, y.conv))
        elif isinstance(x, AttentionLayerState):
            assert x.keys.shape == y.keys.shape and x.values.shape == y.values.shape
            worst = max(worst, rel(x.keys, y.keys))
            if y.values.numel():
                worst = max(worst, rel(x.values, y.values))
    return worst


def random_batches(rng: random.Random, n: int) -> list[list[int]]:
    """A random arrival order cut into random batches (what arrived while the worker was busy)."""
    order = list(range(n))
    rng.shuffle(order)
    batches, i = [], 0
    while i < n:
        k = rng.randint(1, 3)
        batches.append(order[i:i + k])
        i += k
    return batches


def test_arrived_runs_are_consecutive_and_cover_the_prompt(fresh_seed):
    rng = random.Random(fresh_seed)
    assert list(arrived_run({0, 1, 3}, 0, 5)) == [0, 1]
    assert list(arrived_run({0, 1, 3}, 2, 5)) == []
    for _ in range(200):
        n = rng.randint(1, 12)
        runs = list(runs_as_arriving(random_batches(rng, n), n))
        assert [i for r in runs for i in r] == list(range(n))
    with pytest.raises(ValueError):
        list(runs_as_arriving([[0], [2]], 3))


@pytest.mark.parametrize("seam", [0, 3, 8])
def test_runs_composed_as_they_arrive_equal_segment_major(engine, seam, fresh_seed):
    rng = random.Random(fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    n = rng.randint(5, 9)
    # odd sizes: shorter than the conv kernel, shorter than the seam, and longer. Not 1: the
    # reference's forward of a 1-token seam is a Mamba2 decode step (no dt clamp, as HF's decode),
    # where a run's batched seams are a prefill (clamped, as full recompute is).
    lengths = [rng.choice([2, 3, 5, 7, 11]) if rng.random() < 0.3 else rng.randint(9, 61) for _ in range(n)]
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in lengths]
    query = torch.randint(0, engine.vocab_size, (rng.randint(1, 6),), generator=g).tolist()
    entries = [build_entry(engine, s, seam) for s in segs]
    reference = prefill_segment_major(engine, entries)
    for capacity in (None, sum(lengths)):  # two arrival orders: keys concatenated, then in an arena
        batches = random_batches(rng, n)
        state = engine.new_state()
        runs = list(runs_as_arriving(batches, n))
        for run in runs:
            state = compose_run(engine, state, [entries[i] for i in run], capacity=capacity)
        err = state_rel(state, reference)
        assert err < 1e-5, (lengths, batches, err)
        _, logits, after = engine.forward(query, state)
        _, ref_logits, ref_after = engine.forward(query, reference)
        assert rel(logits, ref_logits) < 1e-5, (lengths, batches)
        assert engine.decode_step(int(logits[-1].argmax()), after)[0].argmax() == \
            engine.decode_step(int(ref_logits[-1].argmax()), ref_after)[0].argmax()


def test_composing_runs_out_of_order_is_caught(engine, fresh_seed):
    """The comparison above can fail: a run composed before the one preceding it is not the prompt."""
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in (23, 17, 31)]
    entries = [build_entry(engine, s, 8) for s in segs]
    reference = prefill_segment_major(engine, entries)
    swapped = compose_run(engine, compose_run(engine, engine.new_state(), entries[:1]), [entries[2], entries[1]])
    assert state_rel(swapped, reference) > 1e-3


def test_a_kept_state_is_never_overwritten_by_an_arena(engine, fresh_seed):
    """Continuing twice from one state (the second continuation may not write where the first
    did): both equal the reference, and the first is unchanged after the second."""
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in (19, 27, 14, 33)]
    entries = [build_entry(engine, s, 8) for s in segs]
    cap = sum(len(s) for s in segs)
    prefix = compose_run(engine, engine.new_state(), entries[:2], capacity=cap)
    a = compose_run(engine, prefix, entries[2:], capacity=cap)
    a_copy = a.clone()
    b = compose_run(engine, prefix, [entries[3], entries[2]], capacity=cap)  # another prompt's tail
    assert state_rel(a, a_copy) == 0.0
    assert state_rel(a, prefill_segment_major(engine, entries)) < 1e-5
    assert state_rel(b, prefill_segment_major(engine, entries[:2] + [entries[3], entries[2]])) < 1e-5
    # once composition is over the state stops carrying the arenas (their keys stay views)
    done = without_arenas(a)
    assert ARENAS in a.extra and ARENAS not in done.extra and state_rel(done, a) == 0.0


def test_every_family_composes_a_run_in_one_call_per_linear_layer(engine, fresh_seed, monkeypatch):
    """The layer-major pass composes each linear layer's run in one kernels.compose.compose_run_states
    call (one Triton launch on CUDA), the per-head decays of lightning attention (MiniMax) included;
    given as [H] instead of per token, such a decay composes to the same state."""
    import common.engine.pic.seam_plan as seam_plan

    calls, real = [], seam_plan.compose_run_states
    monkeypatch.setattr(seam_plan, "compose_run_states",
                        lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in (19, 27, 14)]
    entries = [build_entry(engine, s, w) for s, w in zip(segs, (8, 3, 6))]  # seams of 3 rows padded to 8
    reference = prefill_segment_major(engine, entries)
    calls.clear()
    state = compose_run(engine, engine.new_state(), entries)
    linear = [layer for layer in engine.model.layers if layer.kind == "linear"]
    assert calls == [len(segs)] * len(linear)
    assert state_rel(state, reference) < 1e-5
    head_gated = [layer.mixer for layer in linear if layer.mixer.family == "retnet"]
    for mixer in head_gated:  # the gate as one log-decay per head
        features = mixer.features
        monkeypatch.setattr(mixer, "features", lambda x, tail, f=features: _head_gate(f(x, tail)))
    if head_gated:
        assert state_rel(compose_run(engine, engine.new_state(), entries), reference) < 1e-5


def _head_gate(features):
    q, k, v, g, *rest = features
    assert g.dim() == 3 and torch.equal(g, g[:1, :1].expand_as(g))  # the same on every token
    return (q, k, v, g[0, 0], *rest)
