"""kernels.linear_attn.lowrank: the WY factors of a short delta-family segment reproduce the dense T
that segment_summary computes, and apply_lowrank equals the dense product, on random inputs of odd
sizes with fresh seeds (relative errors)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear_attn import segment_summary
from kernels.linear_attn.lowrank import LOWRANK_FAMILIES, apply_lowrank, lowrank_dense, lowrank_pays, wy_factors


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(family, B, L, H, K, V, gen, dtype):
    k = F.normalize(torch.randn(B, L, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, L, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, L, H, generator=gen, dtype=torch.float64)
    g = -(0.01 + torch.rand(B, L, H, generator=gen, dtype=torch.float64)) if family == "gated_deltanet" else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(k), cast(v), cast(beta), cast(g)


@pytest.mark.parametrize("family", LOWRANK_FAMILIES)
@pytest.mark.parametrize("B,L,H,K,V", [(1, 1, 1, 8, 3), (2, 5, 3, 16, 7), (1, 11, 2, 33, 9), (1, 40, 2, 24, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factors_reproduce_the_dense_transition(family, B, L, H, K, V, dtype, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    k, v, beta, g = _inputs(family, B, L, H, K, V, gen, dtype)
    dense = segment_summary(family, k, v, g=g, beta=beta).T  # [B, H, K, K] (fp32)
    decay, W, Kf = wy_factors(k, beta, g)
    assert W.shape == Kf.shape == (B, H, L, K)
    tol = 1e-5  # the dense T is fp32 either way: its rounding over L steps bounds both dtypes alike
    assert rel(lowrank_dense(decay, W, Kf), dense) < tol
    S = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    ref = lowrank_dense(decay, W, Kf) @ S
    assert rel(apply_lowrank(decay, W, Kf, S), ref) < (1e-6 if dtype == torch.float32 else 1e-12)
    assert rel(apply_lowrank(decay, W, Kf, S), dense.to(dtype) @ S) < tol


def test_a_wrong_factor_is_noticed(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    k, v, beta, g = _inputs("gated_deltanet", 1, 6, 2, 16, 4, gen, torch.float64)
    dense = segment_summary("gated_deltanet", k, v, g=g, beta=beta).T
    decay, W, Kf = wy_factors(k, beta, g)
    assert rel(lowrank_dense(decay, W.flip(2), Kf), dense) > 1e-3  # the order of the tokens matters


def test_lowrank_pays_only_for_short_segments():
    assert lowrank_pays(63, 128) and not lowrank_pays(64, 128) and not lowrank_pays(200, 128)
