"""kernels.linear_attn.segments: one chunked pass with the state at every segment end against one
`linear_attention` call per segment, for every family, on odd segment lengths and fresh seeds."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.linear_attn import FAMILIES, segment_states, segment_states_reference
from tests.kernels.test_linear_attn import make_inputs, rel

TOL = 1e-5


@pytest.fixture
def gen(fresh_seed):
    return torch.Generator().manual_seed(fresh_seed)


def random_ends(gen, n: int, lo: int, hi: int) -> list[int]:
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    ends, t = [], 0
    for _ in range(n):
        t += rng.randint(lo, hi)
        ends.append(t)
    return ends


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 1, 40), (5, 30, 70), (3, 64, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_one_pass_matches_a_call_per_segment(family, shape, with_state, gen):
    n, lo, hi = shape
    ends = random_ends(gen, n, lo, hi)
    B, H, K, V = 2, 2, 16, 24
    q, k, v, g, beta = make_inputs(family, B, ends[-1], H, K, V, gen, "fast")
    S0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
    o_ref, st_ref = segment_states_reference(family, q, k, v, g=g, beta=beta, initial_state=S0, ends=ends)
    o, st = segment_states(family, q, k, v, g=g, beta=beta, initial_state=S0, ends=ends)
    assert o.shape == o_ref.shape and o.dtype == q.dtype
    assert rel(o, o_ref) <= TOL, rel(o, o_ref)
    assert len(st) == len(ends)
    for j, (a, b) in enumerate(zip(st, st_ref)):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert rel(a, b) <= TOL, (j, rel(a, b))


@pytest.mark.parametrize("family", ["gated_deltanet", "retnet", "kda"])
def test_empty_segments_keep_the_state(family, gen):
    """A segment of no tokens ends where the one before it did (the first: the initial state)."""
    B, H, K, V = 1, 2, 8, 8
    ends = [0, 37, 37, 90, 90]
    q, k, v, g, beta = make_inputs(family, B, 90, H, K, V, gen, "slow")
    S0 = torch.randn(B, H, K, V, generator=gen)
    _, st = segment_states(family, q, k, v, g=g, beta=beta, initial_state=S0, ends=ends)
    _, st_ref = segment_states_reference(family, q, k, v, g=g, beta=beta, initial_state=S0, ends=ends)
    assert torch.equal(st[0], S0)
    assert torch.equal(st[1], st[2]) and torch.equal(st[3], st[4])
    for a, b in zip(st, st_ref):
        assert rel(a, b) <= TOL


@pytest.mark.parametrize("ends", [[5, 3, 8], [4, 7], [], [0, 10, 12]])
def test_bad_ends_are_refused(ends, gen):
    q, k, v, g, beta = make_inputs("gated_deltanet", 1, 9, 2, 8, 8, gen)
    with pytest.raises(ValueError, match="segment ends"):
        segment_states("gated_deltanet", q, k, v, g=g, beta=beta, ends=ends)


def test_one_chunked_pass_for_all_segments(gen, monkeypatch):
    """The fast path really is one pass (the reference makes one per segment), so the comparisons
    above compare two different computations."""
    import kernels.linear_attn.chunk as chunk_mod
    import kernels.linear_attn.segments as seg_mod

    calls = []
    real = chunk_mod._chunk_core

    def counting(*a, **kw):
        calls.append(a[1].shape[1])  # k's length
        return real(*a, **kw)

    monkeypatch.setattr(seg_mod, "_chunk_core", counting)
    ends = [17, 50, 51, 90, 130]
    q, k, v, g, beta = make_inputs("gated_deltanet", 1, ends[-1], 2, 8, 8, gen)
    segment_states("gated_deltanet", q, k, v, g=g, beta=beta, ends=ends)
    assert len(calls) == 1 and calls[0] % 32 == 0 and calls[0] >= ends[-1]
