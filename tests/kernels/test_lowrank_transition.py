"""kernels.linear_attn.lowrank: the WY factors of a short delta-family segment reproduce the dense T
that segment_summary computes, and apply_lowrank equals the dense product, on random inputs of odd
sizes with fresh seeds (relative errors). The general factors entries store (transition_factors,
LowRankT: every delta family, kda's per-channel gates included) against a plain fp64 product of the
per-token transitions and against segment_summary, and LowRankT.apply against the formed T; a run's
transitions stacked for one composition (stack_transitions) against the formed ones."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear_attn import segment_summary
from kernels.linear_attn.lowrank import (FACTOR_FAMILIES, LOWRANK_FAMILIES, LowRankT, apply_lowrank, lowrank_dense,
                                        lowrank_pays, stack_transitions, transition_factors,
                                        wy_factors)


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
    assert lowrank_pays(62, 128, itemsize=2) and not lowrank_pays(63, 128, itemsize=2)  # gamma stays fp32


def _gates(family, B, L, H, K, gen, strength=1.0):
    """Log gates of `family` (None, per head [B, L, H], per channel [B, L, H, K]), <= 0."""
    if family == "deltanet":
        return None
    shape = (B, L, H) if family == "gated_deltanet" else (B, L, H, K)
    return -strength * (0.01 + torch.rand(shape, generator=gen, dtype=torch.float64))


def product_reference(k, beta, g):
    """T = A_L ... A_1 with A_t = (I - b_t k_t k_t^T) diag(exp g_t), one token at a time in fp64
    (keys repeated to the value heads of beta): the plain definition."""
    B, L, Hk, K = k.shape
    H = beta.shape[2]
    k = k.double().repeat_interleave(H // Hk, dim=2)
    T = torch.eye(K, dtype=torch.float64).expand(B, H, K, K).clone()
    for t in range(L):
        if g is not None:
            gt = g[:, t].double()
            T = (gt.exp().unsqueeze(-1) if gt.dim() == 3 else gt.exp()[..., None, None]) * T
        kt = k[:, t]
        T = T - beta[:, t].double()[..., None, None] * kt.unsqueeze(-1) * (kt.unsqueeze(-2) @ T)
    return T


@pytest.mark.parametrize("family", FACTOR_FAMILIES)
@pytest.mark.parametrize("B,L,Hk,H,K,V", [(1, 1, 1, 1, 8, 3), (2, 5, 3, 3, 16, 7), (1, 11, 2, 4, 33, 9),
                                          (1, 23, 1, 3, 17, 5)])
def test_transition_factors_reproduce_the_product(family, B, L, Hk, H, K, V, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    k = F.normalize(torch.randn(B, L, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(B, L, H, generator=gen, dtype=torch.float64)  # (0, 2): OLMo's range
    g = _gates(family, B, L, H, K, gen)
    f = transition_factors(k.float(), beta.float(), None if g is None else g.float())
    assert f.gamma.shape == (B, H, K) and f.P.shape == f.Q.shape == (B, H, L, K) and f.rank == L
    assert f.P.dtype == torch.float32 and f.shape == (B, H, K, K)
    ref = product_reference(k.float(), beta.float(), None if g is None else g.float())
    assert rel(f.dense(), ref) < 1e-5  # fp32 inputs and factors; the solve runs in fp64
    v = torch.randn(B, L, H, V, generator=gen, dtype=torch.float64)
    dense = segment_summary(family, k.repeat_interleave(H // Hk, 2), v, g=g, beta=beta).T  # the chunked kernel's T
    assert rel(f.dense(), dense) < 1e-5
    S = torch.randn(B, H, K, V, generator=gen)
    assert rel(f.apply(S), f.dense() @ S) < 1e-6
    assert f.numel() == B * H * (K + 2 * L * K)


@pytest.mark.parametrize("family", ["gated_deltanet", "kda"])
def test_strong_gates_do_not_overflow(family, fresh_seed):
    """Gates of -30 a token on half the heads (gated_deltanet) or channels (kda): exp(-G) would
    overflow fp32 after 3 tokens and fp64 after 24, so a factorisation that divides by the decay
    fails; these factors only ever exponentiate differences <= 0. The other half decays slowly,
    so T is far from 0 and the comparison measures something."""
    gen = torch.Generator().manual_seed(fresh_seed)
    B, L, H, K = 1, 40, 2, 48
    k = F.normalize(torch.randn(B, L, H, K, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(B, L, H, generator=gen, dtype=torch.float64)
    g = _gates(family, B, L, H, K, gen, strength=0.02)
    if family == "kda":
        g[..., : K // 2] *= 1500.0
    else:
        g[..., 0] *= 1500.0
    f = transition_factors(k, beta, g)
    assert all(torch.isfinite(t).all() for t in (f.gamma, f.P, f.Q))
    ref = product_reference(k, beta, g)
    assert ref.norm() > 1e-3 and rel(f.dense(), ref) < 1e-5


def test_lowrank_t_stands_in_for_a_tensor(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    k = F.normalize(torch.randn(1, 6, 2, 16, generator=gen), dim=-1)
    f = transition_factors(k, torch.rand(1, 6, 2, generator=gen), -torch.rand(1, 6, 2, 16, generator=gen))
    assert f.to(torch.float64).dtype == torch.float64 and f.float().dtype == torch.float32
    assert f.device == k.device and f.contiguous().P.is_contiguous() and f.element_size() == 4
    wrong = LowRankT(f.gamma, f.P.flip(2), f.Q)  # the tokens' order matters
    assert rel(wrong.dense(), f.dense()) > 1e-3


def _factors(gen, L, H=3, K=16):
    k = F.normalize(torch.randn(1, L, H, K, generator=gen), dim=-1)
    return transition_factors(k, torch.rand(1, L, H, generator=gen), -torch.rand(1, L, H, K, generator=gen))


def test_stacked_factors_of_different_ranks_are_the_formed_transitions(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    Ts = [_factors(gen, L) for L in (1, 7, 4)]
    stacked = stack_transitions(Ts)
    assert isinstance(stacked, LowRankT) and stacked.rank == 7 and stacked.P.shape == (3, 3, 7, 16)
    formed = torch.cat([T.dense() for T in Ts], 0)
    assert rel(stacked.dense(), formed) < 1e-6  # the zero rows padding ranks 1 and 4 add nothing
    S = torch.randn(3, 3, 16, 5, generator=gen)
    assert rel(stacked.apply(S), formed @ S) < 1e-5
    assert rel(stacked.select(1).dense(), Ts[1].dense()) < 1e-6
    with pytest.raises(ValueError):
        Ts[1].padded(3)


def test_a_run_mixing_factors_and_dense_transitions_is_stacked_dense(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    low, dense = _factors(gen, 5), torch.randn(1, 3, 16, 16, generator=gen, dtype=torch.float64)
    stacked = stack_transitions([low, dense, low])
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (3, 3, 16, 16)
    assert stacked.dtype == torch.float32  # mixed dtypes widen to fp32
    assert rel(stacked[0], low.dense()[0]) < 1e-7 and rel(stacked[1], dense[0]) < 1e-7
    plain = [torch.randn(1, 2, 4, 4, generator=gen) for _ in range(3)]
    assert torch.equal(stack_transitions(plain), torch.cat(plain, 0))
    with pytest.raises(ValueError):
        stack_transitions([])
