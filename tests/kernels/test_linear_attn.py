"""Chunked linear attention vs the per-token naive reference, every family (kernels/linear_attn).

Relative Frobenius error ||a - b|| / ||b|| <= 1e-5 in fp32 on random inputs (fresh seeds, printed),
odd lengths, with and without an initial state, slow and fast decays, k L2-normalised for the
delta families; bf16 inputs within a looser bound; out= buffers pre-filled with NaN; inputs never
modified; all gate code paths (midpoint, recursive split, token level) forced.
"""
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels.linear_attn as la
import kernels.linear_attn.chunk as chunk_mod
import kernels.linear_attn.intra as intra
from kernels.linear_attn import (
    DELTA_FAMILIES,
    FAMILIES,
    FAMILY_GATE,
    chunk_linear_attn,
    chunk_with_transition,
    linear_attention,
    naive_recurrent,
    recurrent_step,
)
from kernels.linear_attn.chunk import (
    chunk_deltanet,
    chunk_gated_deltanet,
    chunk_gla,
    chunk_kda,
    chunk_mamba2,
    chunk_retnet,
)
from kernels.linear_attn.naive import (
    naive_deltanet,
    naive_gated_deltanet,
    naive_gla,
    naive_kda,
    naive_mamba2,
    naive_retnet,
)

TOL = 1e-5


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_inputs(family, B, T, H, K, V, gen, decay="slow", dtype=torch.float32):
    """Random inputs for one family. decay: slow (|g| ~ 0.01-0.1 per token), fast (~0.5-3),
    extreme (per-channel up to ~200 nats per token, mixed with near-zero channels)."""
    r = lambda *s: torch.randn(*s, generator=gen)
    u = lambda *s: torch.rand(*s, generator=gen)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    if family in DELTA_FAMILIES:
        k = F.normalize(k, dim=-1)
    lo, hi = {"slow": (0.01, 0.1), "fast": (0.5, 3.0), "extreme": (0.0, 200.0)}[decay]
    gate = FAMILY_GATE[family]
    shape = {"head": (H,), "token": (B, T, H), "channel": (B, T, H, K), None: None}[gate]
    g = None
    if shape is not None:
        g = -(lo + (hi - lo) * u(*shape))
        if decay == "extreme" and gate == "channel":
            g = g * (u(*shape) < 0.5)  # half the channels barely decay
    beta = u(B, T, H) if family in DELTA_FAMILIES else None
    cast = lambda x: None if x is None else x.to(dtype)
    return cast(q), cast(k), cast(v), cast(g), cast(beta)


@pytest.fixture
def gen(fresh_seed):
    return torch.Generator().manual_seed(fresh_seed)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 63, 257, 190])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", ["slow", "fast"])
def test_chunk_matches_naive(family, T, with_state, decay, gen):
    B, H, K, V = 2, 2, 16, 24
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, decay)
    S0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
    delta = family in DELTA_FAMILIES
    ins = [x.clone() if x is not None else None for x in (q, k, v, g, beta, S0)]
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, S0, None, delta)
    o, S = chunk_linear_attn(q, k, v, g, beta, S0, None, delta)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel(o, o_ref) <= TOL, rel(o, o_ref)
    assert rel(S, S_ref) <= TOL, rel(S, S_ref)
    for a, b in zip(ins, (q, k, v, g, beta, S0)):  # inputs are never written to
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_extreme_decays_finite_and_exact(family, gen):
    B, T, H, K, V = 1, 150, 2, 16, 16
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "extreme")
    S0 = torch.randn(B, H, K, V, generator=gen)
    delta = family in DELTA_FAMILIES
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, S0, None, delta)
    o, S = chunk_linear_attn(q, k, v, g, beta, S0, None, delta)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel(o, o_ref) <= TOL and rel(S, S_ref) <= TOL, (rel(o, o_ref), rel(S, S_ref))


@pytest.mark.parametrize("family", ["gla", "kda"])
@pytest.mark.parametrize("safe", [0.0, 0.5, 1e9])
def test_per_channel_gate_paths(family, safe, gen, monkeypatch):
    """Force every branch of the per-channel intra-chunk scores: recursion down to single tokens
    (safe=0), an intermediate split, and one midpoint block for the whole chunk (safe=inf)."""
    monkeypatch.setattr(intra, "SAFE_EXP", safe)
    B, T, H, K, V = 1, 130, 2, 16, 16
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "slow")
    delta = family in DELTA_FAMILIES
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, None, None, delta)
    o, S = chunk_linear_attn(q, k, v, g, beta, None, None, delta)
    assert rel(o, o_ref) <= TOL and rel(S, S_ref) <= TOL


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
@pytest.mark.parametrize("family", ["mamba2", "gla", "kda"])
def test_other_chunk_sizes(family, chunk_size, gen):
    B, T, H, K, V = 1, 200, 2, 16, 16
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "fast")
    delta = family in DELTA_FAMILIES
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, None, None, delta)
    o, S = chunk_linear_attn(q, k, v, g, beta, None, None, delta, chunk_size=chunk_size)
    assert rel(o, o_ref) <= TOL and rel(S, S_ref) <= TOL


def test_family_wrappers_match_naive_wrappers(gen):
    B, T, H, K, V = 1, 70, 2, 16, 16
    pairs = {
        "retnet": (chunk_retnet, naive_retnet),
        "mamba2": (chunk_mamba2, naive_mamba2),
        "gla": (chunk_gla, naive_gla),
        "deltanet": (chunk_deltanet, naive_deltanet),
        "gated_deltanet": (chunk_gated_deltanet, naive_gated_deltanet),
        "kda": (chunk_kda, naive_kda),
    }
    for fam, (ours, ref) in pairs.items():
        q, k, v, g, beta = make_inputs(fam, B, T, H, K, V, gen, "fast")
        S0 = torch.randn(B, H, K, V, generator=gen)
        args = [x for x in (g, beta) if x is not None]
        o1, S1 = ours(q, k, v, *args, initial_state=S0)
        o2, S2 = ref(q, k, v, *args, initial_state=S0)
        assert rel(o1, o2) <= TOL and rel(S1, S2) <= TOL, fam


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_inputs(family, gen):
    B, T, H, K, V = 1, 150, 2, 32, 32
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "slow", dtype=torch.bfloat16)
    S0 = torch.randn(B, H, K, V, generator=gen)
    delta = family in DELTA_FAMILIES
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, S0, None, delta)  # fp32 on the same bf16 values
    o, S = chunk_linear_attn(q, k, v, g, beta, S0, None, delta)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel(S, S_ref) <= TOL
    assert rel(o.float(), o_ref) <= 1e-2  # only the bf16 rounding of o itself


@pytest.mark.parametrize("family", ["gated_deltanet", "gla"])
def test_out_buffer_prefilled_with_nan(family, gen):
    B, T, H, K, V = 2, 100, 2, 16, 24
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "fast")
    delta = family in DELTA_FAMILIES
    out = torch.full((B, T, H, V), float("nan"))
    o, S = chunk_linear_attn(q, k, v, g, beta, None, None, delta, out=out)
    assert o is out and torch.isfinite(out).all()
    o_ref, _ = naive_recurrent(q, k, v, g, beta, None, None, delta)
    assert rel(out, o_ref) <= TOL


@pytest.mark.parametrize("family", ["gated_deltanet", "kda", "mamba2"])
def test_grouped_value_heads(family, gen):
    """q/k with fewer heads than v (each q/k head serves consecutive value heads)."""
    B, T, Hk, rep, K, V = 1, 90, 2, 2, 16, 16
    H = Hk * rep
    q, k, _, _, _ = make_inputs(family, B, T, Hk, K, V, gen, "fast")
    _, _, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "fast")
    delta = family in DELTA_FAMILIES
    o, S = chunk_linear_attn(q, k, v, g, beta, None, None, delta)
    qr, kr = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    o_ref, S_ref = naive_recurrent(qr, kr, v, g, beta, None, None, delta)
    assert rel(o, o_ref) <= TOL and rel(S, S_ref) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_transition_operator_in_one_pass(family, gen):
    """chunk_with_transition: T . S0 + S(C|0) == S(C|S0), and the outputs equal the prefill's."""
    B, T, H, K, V = 1, 140, 2, 16, 16
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "fast")
    S0 = torch.randn(B, H, K, V, generator=gen)
    delta = family in DELTA_FAMILIES
    o, S, Tm = chunk_with_transition(q, k, v, g, beta, S0, None, delta)
    _, Szero, Tm2 = chunk_with_transition(None, k, v, g, beta, None, None, delta)
    o_ref, S_ref = naive_recurrent(q, k, v, g, beta, S0, None, delta)
    assert rel(o, o_ref) <= TOL and rel(S, S_ref) <= TOL
    assert rel(Tm, Tm2) <= TOL
    if Tm.dim() == 2:
        TS0 = Tm[..., None, None] * S0
    elif Tm.dim() == 3:
        TS0 = Tm[..., None] * S0
    else:
        TS0 = Tm @ S0
    assert rel(TS0 + Szero, S_ref) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_dispatcher_and_decode_step(family, gen):
    B, T, H, K, V = 2, 7, 2, 16, 16
    q, k, v, g, beta = make_inputs(family, B, T, H, K, V, gen, "fast")
    S0 = torch.randn(B, H, K, V, generator=gen)
    o_ref, S_ref = linear_attention(family, q, k, v, g=g, beta=beta, initial_state=S0)
    scale = 1.0 if family in ("mamba2", "mamba") else None
    o_n, S_n = naive_recurrent(q, k, v, g, beta, S0, scale, family in DELTA_FAMILIES)
    assert rel(o_ref, o_n) <= TOL and rel(S_ref, S_n) <= TOL
    S = S0.clone()
    outs = []
    for t in range(T):
        gt = g if (g is None or g.dim() == 1) else g[:, t : t + 1]
        bt = None if beta is None else beta[:, t : t + 1]
        o, S_new = recurrent_step(family, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g=gt, beta=bt, state=S)
        assert o.shape == (B, 1, H, V)
        outs.append(o)
        S = S_new
    assert rel(torch.cat(outs, 1), o_ref) <= TOL and rel(S, S_ref) <= TOL
    # squeezed [B, H, .] form and the in-place variant
    buf = torch.full_like(S0, float("nan"))
    gt = g if (g is None or g.dim() == 1) else g[:, 0]
    o1, S1 = recurrent_step(family, q[:, 0], k[:, 0], v[:, 0], gt, None if beta is None else beta[:, 0], S0, out_state=buf)
    o2, S2 = naive_recurrent(q[:, :1], k[:, :1], v[:, :1], None if g is None else (g if g.dim() == 1 else g[:, :1]),
                             None if beta is None else beta[:, :1], S0, scale, family in DELTA_FAMILIES)
    assert S1 is buf and rel(S1, S2) <= TOL and rel(o1, o2[:, 0]) <= TOL
    assert not torch.isnan(S0).any()


def test_cpu_never_imports_fla(gen):
    q, k, v, g, beta = make_inputs("gated_deltanet", 1, 20, 2, 16, 16, gen)
    linear_attention("gated_deltanet", q, k, v, g=g, beta=beta)
    assert "fla" not in sys.modules


def test_empty_sequence():
    q = torch.randn(1, 0, 2, 8)
    S0 = torch.randn(1, 2, 8, 8)
    o, S = chunk_linear_attn(q, q, torch.randn(1, 0, 2, 8), torch.zeros(1, 0, 2), None, S0)
    assert o.shape == (1, 0, 2, 8) and torch.equal(S, S0)


def test_bad_arguments():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError):
        linear_attention("nope", q, q, q)
    with pytest.raises(ValueError):
        linear_attention("gated_deltanet", q, q, q, g=torch.zeros(1, 4, 2))  # no beta
    with pytest.raises(ValueError):
        chunk_linear_attn(q, q, q, chunk_size=48)
    assert la.fla_available.__doc__


@pytest.mark.parametrize("C", [1, 2, 8, 32, 64, 128])
def test_unit_lower_inverse(C, gen):
    """(I + strict_lower(L))^-1 by blocked forward substitution == LAPACK; the upper triangle and
    the diagonal of L are never read (filled with NaN here)."""
    L = torch.randn(3, 5, C, C, generator=gen) * 0.3
    ref = torch.linalg.solve_triangular(L.tril(-1) + torch.eye(C), torch.eye(C).expand(3, 5, C, C), upper=False)
    L = L.tril(-1) + torch.full((C, C), float("nan")).triu()
    X = intra.unit_lower_inv(L)
    assert rel(X, ref) <= 1e-6
