"""Mamba v1 (the "mamba" family, kernels/linear_attn/mamba.py): the literal selective scan in
Mamba's own layout against the family-contract reference, the chunked path, the decode step,
the diagonal transition operator (T per channel x state) and its composition — random inputs,
fresh seeds, fp32 relative error <= 1e-5. The generic per-family tests of test_linear_attn.py
and test_compose.py run "mamba" too (it is in FAMILIES)."""
import pytest
import torch

from kernels.linear_attn import (
    compose_chain,
    linear_attention,
    mamba_features,
    naive_add,
    naive_mamba,
    naive_selective_scan,
    prefill_with_summary,
    recurrent_step,
    segment_summary,
    summary_form,
)

TOL = 1e-5


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def mamba_inputs(gen, Bs=2, T=75, D=12, N=8, dt_scale=1.0):
    """u, dt (softplus of a random pre-activation, as the mixer makes it), A = -exp(A_log) [D, N]
    (S4D-real-like spread), B, C."""
    r = lambda *s: torch.randn(*s, generator=gen)
    u = r(Bs, T, D)
    dt = torch.nn.functional.softplus(r(Bs, T, D) - 2.0) * dt_scale
    A = -torch.exp(torch.rand(D, N, generator=gen) * 3.0 - 2.0)
    return u, dt, A, r(Bs, T, N), r(Bs, T, N)


@pytest.fixture
def gen(fresh_seed):
    return torch.Generator().manual_seed(fresh_seed)


@pytest.mark.parametrize("T", [1, 75, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_family_contract_equals_literal_scan(T, with_state, gen):
    u, dt, A, B, C = mamba_inputs(gen, T=T)
    h0 = torch.randn(2, 12, 8, generator=gen) if with_state else None
    y_ref, h_ref = naive_selective_scan(u, dt, A, B, C, initial_state=h0)
    q, k, v, g = mamba_features(u, dt, A, B, C)
    S0 = None if h0 is None else h0.unsqueeze(-1)
    o_n, S_n = naive_mamba(q, k, v, g, initial_state=S0)
    assert rel(o_n[..., 0], y_ref) <= TOL and rel(S_n[..., 0], h_ref) <= TOL
    o_c, S_c = linear_attention("mamba", q, k, v, g=g, initial_state=S0)  # scale 1 by default
    assert o_c.shape == (2, T, 12, 1) and S_c.shape == (2, 12, 8, 1)
    assert rel(o_c[..., 0], y_ref) <= TOL, rel(o_c[..., 0], y_ref)
    assert rel(S_c[..., 0], h_ref) <= TOL, rel(S_c[..., 0], h_ref)


def test_matches_transformers_selective_scan(gen):
    """The same numbers as transformers' torch reference of Mamba v1 (D skip and z gate off)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    u, dt, A, B, C = mamba_inputs(gen, Bs=1, T=40)
    y_hf, h_hf = mamba_selective_scan(u.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2),
                                      C.transpose(1, 2), return_last_state=True)
    q, k, v, g = mamba_features(u, dt, A, B, C)
    o, S = linear_attention("mamba", q, k, v, g=g)
    assert rel(o[..., 0], y_hf.transpose(1, 2)) <= TOL and rel(S[..., 0], h_hf) <= TOL


def test_strong_decays_stay_finite_and_exact(gen):
    """dt up to ~20 with |A| up to e: per-token log-decays of tens of nats in some channels, ~0 in
    others — the per-channel block scoring must neither overflow nor lose the slow channels."""
    u, dt, A, B, C = mamba_inputs(gen, T=150, dt_scale=20.0)
    dt = dt * (torch.rand(dt.shape, generator=gen) < 0.5)
    q, k, v, g = mamba_features(u, dt, A, B, C)
    y_ref, h_ref = naive_selective_scan(u, dt, A, B, C)
    o, S = linear_attention("mamba", q, k, v, g=g)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel(o[..., 0], y_ref) <= TOL and rel(S[..., 0], h_ref) <= TOL


def test_decode_steps_continue_a_prefill(gen):
    u, dt, A, B, C = mamba_inputs(gen, T=30)
    q, k, v, g = mamba_features(u, dt, A, B, C)
    y_ref, h_ref = naive_selective_scan(u, dt, A, B, C)
    _, S = linear_attention("mamba", q[:, :20], k[:, :20], v[:, :20], g=g[:, :20])
    outs = []
    for t in range(20, 30):
        sl = slice(t, t + 1)
        o, S = recurrent_step("mamba", q[:, sl], k[:, sl], v[:, sl], g=g[:, sl], state=S)
        outs.append(o)
    assert rel(torch.cat(outs, 1)[..., 0], y_ref[:, 20:]) <= TOL and rel(S[..., 0], h_ref) <= TOL


def test_transition_is_diagonal_per_channel_and_state(gen):
    u, dt, A, B, C = mamba_inputs(gen, T=90)
    q, k, v, g = mamba_features(u, dt, A, B, C)
    s = segment_summary("mamba", k, v, g=g)
    assert summary_form("mamba") == "vector" and s.T.shape == (2, 12, 8)
    # T[d, n] = exp(A[d, n] * sum_t dt_t[d]): one number per channel x state
    want = torch.exp(A[None] * dt.double().sum(1)[..., None]).float()
    assert rel(s.T, want) <= TOL
    # prefill_with_summary from a start state gives the same (T, S|0)
    S0 = torch.randn(2, 12, 8, 1, generator=gen)
    _, S_end, s2 = prefill_with_summary("mamba", q, k, v, g=g, initial_state=S0)
    assert rel(s2.T, s.T) <= TOL and rel(s2.S, s.S) <= 1e-4
    assert rel(S_end[..., 0], naive_selective_scan(u, dt, A, B, C, initial_state=S0[..., 0])[1]) <= TOL


@pytest.mark.parametrize("lengths", [(40, 3, 57), (1, 1, 90, 8, 30)])
def test_segments_compose_to_the_full_run(lengths, gen):
    u, dt, A, B, C = mamba_inputs(gen, Bs=1, T=sum(lengths), dt_scale=0.05)  # slow: segments matter
    q, k, v, g = mamba_features(u, dt, A, B, C)
    _, h_full = naive_selective_scan(u, dt, A, B, C)
    bounds = torch.tensor((0,) + lengths).cumsum(0).tolist()
    sums = [segment_summary("mamba", k[:, a:b], v[:, a:b], g=g[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    S = compose_chain(sums)
    assert rel(S[..., 0], h_full) <= TOL
    # dropping T (the additive ablation) is measurably wrong: the test can fail
    S_add = None
    for s in sums:
        S_add = naive_add(s, S_add)
    assert rel(S_add[..., 0], h_full) > 1e-2
