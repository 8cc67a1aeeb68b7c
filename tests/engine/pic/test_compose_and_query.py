"""The query folded into the last layer-major pass (common.engine.pic.reuse.compose_and_query) against
the plain two steps it replaces (query_after_compose: compose_run, then engine.forward(query)),
on every architecture the engine serves: random odd segment sizes, seam widths and query lengths,
from the empty state and from a composed prefix, keys concatenated or in an arena."""
import random

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.reuse import (compose_and_query, compose_run, prefill_segment_major, query_after_compose,
                                     without_arenas)
from common.engine.pic.seam_plan import ARENAS
from tests.engine.pic.test_compose_runs import rel, state_rel
from tests.support.tiny import PIC_CONFIGS, save_tiny


@pytest.fixture(scope="module", params=sorted(PIC_CONFIGS))
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=29, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path)


def random_prompt(engine, rng: random.Random, g: torch.Generator, seam: int):
    n = rng.randint(2, 7)
    # odd sizes: shorter than the conv kernel, shorter than the seam, and longer (not 1: see
    # test_compose_runs, a 1-token seam is a Mamba2 decode step in the reference)
    lengths = [rng.choice([2, 3, 5, 7]) if rng.random() < 0.3 else rng.randint(9, 49) for _ in range(n)]
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in lengths]
    query = torch.randint(0, engine.vocab_size, (rng.randint(1, 9),), generator=g).tolist()
    return [build_entry(engine, s, seam) for s in segs], query


def check_same(engine, got, want, what) -> None:
    (logits, state), (ref_logits, ref_state) = got, want
    assert logits.shape == (engine.vocab_size,)
    assert rel(logits, ref_logits) < 1e-5, what
    assert state_rel(without_arenas(state), ref_state) < 1e-5, what
    tok = int(ref_logits.argmax())  # the next step decodes the same from both states
    assert rel(engine.decode_step(tok, state)[0], engine.decode_step(tok, ref_state)[0]) < 1e-5, what


@pytest.mark.parametrize("seam", [0, 2, 8])
def test_folded_query_equals_compose_then_query(engine, seam, fresh_seed):
    rng = random.Random(fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    entries, query = random_prompt(engine, rng, g, seam)
    want = query_after_compose(engine, engine.new_state(), entries, query)
    total = sum(e.n_tokens for e in entries) + len(query)
    for capacity in (None, total):
        check_same(engine, compose_and_query(engine, engine.new_state(), entries, query, capacity=capacity),
                   want, (seam, capacity, [e.n_tokens for e in entries], len(query)))
    # and against the segment-major reference, one segment at a time
    _, ref_logits, _ = engine.forward(query, prefill_segment_major(engine, entries))
    assert rel(compose_and_query(engine, engine.new_state(), entries, query)[0], ref_logits[-1]) < 1e-5


def test_folded_query_after_a_composed_prefix(engine, fresh_seed):
    """The mixed order: a run already composed (its keys in the arena), the last run and the query folded."""
    rng = random.Random(fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    entries, query = random_prompt(engine, rng, g, 8)
    cut = rng.randint(1, len(entries) - 1)
    cap = sum(e.n_tokens for e in entries) + len(query)
    prefix = compose_run(engine, engine.new_state(), entries[:cut], capacity=cap)
    want = query_after_compose(engine, prefix, entries[cut:], query)
    got = compose_and_query(engine, prefix, entries[cut:], query, capacity=cap)
    check_same(engine, got, want, (cut, [e.n_tokens for e in entries], len(query)))
    assert ARENAS in got[1].extra and ARENAS not in without_arenas(got[1]).extra


def test_a_query_folded_at_the_wrong_place_is_caught(engine, fresh_seed):
    """The comparison can fail: the same tokens with the query before the last segment differ."""
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in (21, 17, 26)]
    entries = [build_entry(engine, s, 8) for s in segs]
    query = torch.randint(0, engine.vocab_size, (5,), generator=g).tolist()
    folded, _ = compose_and_query(engine, engine.new_state(), entries, query)
    moved, _ = query_after_compose(engine, engine.new_state(), entries[:2], query)
    assert rel(folded, moved) > 1e-3
    with pytest.raises(ValueError):
        compose_and_query(engine, engine.new_state(), entries, [])


def test_bodies_shorter_than_the_conv_pass_the_seams_conv_inputs_on(engine, fresh_seed):
    """A body of fewer tokens than the conv reaches back (here 1 and 2) leaves part of its seam's
    conv inputs in the conv state the next seam starts from: the run then projects its seams'
    conv inputs (elsewhere each body's cached tail is that state)."""
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, engine.vocab_size, (L,), generator=g).tolist() for L in (13, 9, 10, 21)]
    entries = [build_entry(engine, s, 8) for s in segs]
    assert state_rel(compose_run(engine, engine.new_state(), entries), prefill_segment_major(engine, entries)) < 1e-5
