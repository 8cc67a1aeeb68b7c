"""Causal attention with a past (common.engine.layers.attention): the fast paths against the definition."""
import pytest
import torch

import common.engine.layers.attention as attention
from common.engine.layers.attention import causal_attention, causal_attention_reference

# (q heads, kv heads, Tq, Tk, head dim, value head dim): odd sizes, GQA, decode, no past,
# and a value head dim that differs (the CPU flash kernel refuses it: the masked path then)
SHAPES = [(4, 2, 7, 19, 16, 16), (6, 3, 1, 5, 8, 8), (4, 4, 9, 9, 16, 16), (4, 2, 5, 23, 16, 8),
          (8, 2, 33, 97, 32, 32), (2, 1, 3, 4, 8, 8), (4, 1, 65, 130, 24, 24)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_causal_attention_matches_the_definition(shape, dtype, tol, fresh_seed):
    H, Hk, Tq, Tk, D, Dv = shape
    g = torch.Generator().manual_seed(fresh_seed)
    q = torch.randn(2, H, Tq, D, generator=g).to(dtype)
    k = torch.randn(2, Hk, Tk, D, generator=g).to(dtype)
    v = torch.randn(2, Hk, Tk, Dv, generator=g).to(dtype)
    scale = float(torch.rand((), generator=g)) + 0.05
    got = causal_attention(q, k, v, scale)
    ref = causal_attention_reference(q, k, v, scale)
    assert got.shape == (2, Tq, H, Dv) and got.dtype == dtype
    # relative to each output's size (at least 1): a bf16 output in [4, 8) is one unit in the last
    # place, 2^-5, from its neighbours, past an absolute 3e-2 (failed so at seed 2911952868)
    assert ((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1.0)).max() < tol


def test_the_offset_path_is_the_merge_and_the_fallback_agrees(fresh_seed, monkeypatch):
    """Tq < Tk on CPU goes through the log-sum-exp merge; without the CPU flash kernel the
    lower-right causal bias gives the same numbers."""
    g = torch.Generator().manual_seed(fresh_seed)
    q, k, v = torch.randn(1, 4, 11, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g), \
        torch.randn(1, 2, 40, 16, generator=g)
    calls = []
    real = attention._past_and_diagonal
    monkeypatch.setattr(attention, "_past_and_diagonal", lambda *a: calls.append(1) or real(*a))
    merged = causal_attention(q, k, v, 0.25)
    assert calls == [1]
    monkeypatch.setattr(attention, "_CPU_FLASH", None)
    fallback = causal_attention(q, k, v, 0.25)
    assert calls == [1]
    ref = causal_attention_reference(q, k, v, 0.25)
    assert (merged - ref).abs().max() < 1e-5 and (fallback - ref).abs().max() < 1e-5
