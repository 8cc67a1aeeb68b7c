"""The kernel-path decision (fla or torch) and the fla path's own torch-side logic, on CPU.

fla itself runs in tests/kernels/test_fla_interpreter.py (its own virtualenv); here: which path each
device/dtype takes, that CPU never imports fla, how operands are handed to fla (grouped heads),
the fallback, and the summary construction of the fla path (augmented value columns, decay
products) checked against our chunk_with_transition with our torch chunk kernel standing in
for fla's (same contract: o, final state).
"""
from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import kernels.linear_attn as la
from kernels.linear_attn import fla_path
from kernels.linear_attn.chunk import chunk_linear_attn, chunk_with_transition
from kernels.linear_attn.naive import DELTA_FAMILIES

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "device, dtype, importable, path",
    [
        ("cpu", FP32, True, "torch"),
        ("cpu", BF16, True, "torch"),
        ("cpu", FP16, True, "torch"),
        ("cuda", FP32, True, "torch"),  # fp32 on a GPU: our torch chunk path (fla's half kernels would round)
        ("cuda", BF16, True, "fla"),
        ("cuda", FP16, True, "fla"),
        ("cuda:3", BF16, True, "fla"),
        ("cuda", BF16, False, "torch"),  # no fla installed: torch, not an error
    ],
)
def test_kernel_path_decision(device, dtype, importable, path):
    assert fla_path.kernel_path(torch.device(device), dtype, fla_importable=importable) == path
    assert fla_path.kernel_path(device, dtype, fla_importable=importable) == path


def test_operand_dtype_follows_the_path(monkeypatch):
    monkeypatch.setitem(fla_path._fla_state, "ok", True)  # as on a GPU machine with fla installed
    assert fla_path.operand_dtype("cuda", BF16) == BF16
    assert fla_path.operand_dtype("cuda", FP16) == FP16
    assert fla_path.operand_dtype("cuda", FP32) == FP32
    assert fla_path.operand_dtype("cpu", BF16) == FP32  # CPU models hand fp32 q/k, as before
    monkeypatch.setitem(fla_path._fla_state, "ok", False)
    assert fla_path.operand_dtype("cuda", BF16) == FP32


def test_cpu_decisions_never_import_fla():
    for dtype in (FP32, BF16, FP16):
        assert fla_path.kernel_path("cpu", dtype) == "torch"
        assert fla_path.operand_dtype("cpu", dtype) == FP32
    assert "fla" not in sys.modules


def test_backend_argument():
    v = torch.randn(1, 4, 2, 8)
    assert not fla_path.use_fla("auto", v)
    assert not fla_path.use_fla("torch", v)
    with pytest.raises(RuntimeError, match="fla"):
        fla_path.use_fla("fla", v)
    with pytest.raises(RuntimeError, match="fla"):
        la.linear_attention("gated_deltanet", v, v, v, g=torch.zeros(1, 4, 2), beta=torch.ones(1, 4, 2), backend="fla")


def test_grouped_value_heads_go_to_fla_as_they_are(fresh_seed):
    """gated_deltanet and kda: fla takes fewer q/k heads than value heads (GVA); the others get
    q/k repeated to the value heads; q, k, beta in v's dtype, gates fp32."""
    gen = torch.Generator().manual_seed(fresh_seed)
    q, k = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)
    v = torch.randn(2, 5, 6, 4, generator=gen).to(FP16)
    g, beta = -torch.rand(2, 5, 6, generator=gen), torch.rand(2, 5, 6, generator=gen)
    for family in ("gated_deltanet", "kda"):
        assert family in fla_path.FLA_GROUPED
        qq, kk, vv, gg, bb = fla_path._operands(family, q, k, v, g, beta)
        assert qq.shape == (2, 5, 2, 8) and qq.dtype == FP16 and torch.equal(kk, k.to(FP16))
        assert gg.dtype == FP32 and bb.dtype == FP16
    for family in ("retnet", "mamba2", "gla", "deltanet"):
        qq, kk, *_ = fla_path._operands(family, q, k, v, g, beta)
        assert qq.shape == (2, 5, 6, 8)
        assert torch.equal(kk[:, :, 3], k[:, :, 1].to(FP16))  # value head 3 reads key head 1


def test_fallback_to_torch_warns_once(monkeypatch):
    monkeypatch.setitem(fla_path._fla_state, "warned", False)

    def broken():
        raise RuntimeError("no kernel image")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fla_path.run_with_fallback("auto", "kda", broken, lambda: "torch") == "torch"
        assert fla_path.run_with_fallback("auto", "kda", broken, lambda: "torch") == "torch"
    assert len([w for w in caught if "fla kda kernel failed" in str(w.message)]) == 1
    with pytest.raises(RuntimeError, match="no kernel image"):
        fla_path.run_with_fallback("fla", "kda", broken, lambda: "torch")


def _inputs(family, gen, B=2, T=37, H=3, K=8, V=5):
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for D in (K, K, V))
    if family in DELTA_FAMILIES:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    gate = {"retnet": (H,), "mamba2": (B, T, H), "gated_deltanet": (B, T, H), "gla": (B, T, H, K), "kda": (B, T, H, K)}
    g = F.logsigmoid(torch.randn(*gate[family], generator=gen) + 2.0) if family in gate else None
    beta = torch.rand(B, T, H, generator=gen) if family in DELTA_FAMILIES else None
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("family", fla_path.FLA_FAMILIES)
def test_fla_summary_construction(family, fresh_seed, monkeypatch):
    """fla_chunk_with_transition's T and S (augmented identity columns for the delta families,
    exp(sum g) for the others) == chunk_with_transition's, with our chunk kernel in fla's place."""
    delta = family in DELTA_FAMILIES

    def torch_as_fla(fam, q, k, v, g, beta, S0, scale):
        assert fam == family
        return chunk_linear_attn(q, k, v, g=g, beta=beta, initial_state=S0, scale=scale, delta=delta)

    monkeypatch.setattr(fla_path, "fla_chunk", torch_as_fla)
    gen = torch.Generator().manual_seed(fresh_seed)
    q, k, v, g, beta, S0 = _inputs(family, gen)
    scale = 0.3
    o, S, T = fla_path.fla_chunk_with_transition(family, q, k, v, g, beta, S0, scale)
    o_ref, S_ref, T_ref = chunk_with_transition(q, k, v, g=g, beta=beta, initial_state=S0, scale=scale, delta=delta)
    assert T.shape == T_ref.shape and T.dtype == FP32
    torch.testing.assert_close(T, T_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    none, S0_free, T0 = fla_path.fla_chunk_with_transition(family, None, k, v, g, beta, None, scale)
    _, S0_ref, _ = chunk_with_transition(None, k, v, g=g, beta=beta, delta=delta)
    assert none is None
    torch.testing.assert_close(S0_free, S0_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(T0, T_ref, rtol=1e-5, atol=1e-6)
