"""Triton kernel: a whole run of segments composed in one launch (seam and body summaries).

The hot path (common.engine.pic.reuse.SeamPlan.run_linear) composes, per linear layer, a run of
n segments whose seams are recomputed: segment i applies its seam's summary (Ta_i, Sa_i), then
its cached body's (Tb_i, Sb_i). One program owns one (batch*head) slice and one BV-wide tile of
the value dimension, keeps the [K, BV] state in fp32 registers, stores it as it enters each seam
(the seams' outputs are then computed from those states in one batched call) and walks all 2n
summaries: one launch per layer instead of one per segment. Same arithmetic per step as
kernels.compose.triton_compose; the reference is kernels.compose.torch_ref.compose_run_states_torch.

Bodies whose T is held as factors (kernels.linear_attn.lowrank: T = diag(gamma) - P^T Q, stacked
with their ranks padded to one bound L by kernels.linear_attn.lowrank.stack_transitions) take the
same launch with LOWRANK set: a body step is acc = gamma * acc - P^T (Q acc) + S, two [BL, BK] x
[BK, BV] products instead of a [BK, BK] one (L < K / 2 wherever the builder keeps factors), and
T is never formed. Fixed configs, so it runs under TRITON_INTERPRET=1 on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.linear_attn.lowrank import LowRankT

from .torch_ref import FORMS, check_run_shapes, infer_form
from .triton_compose import _FORM_ID, compose_step, default_config


@triton.jit
def lowrank_step(acc, Gam_ptr, P_ptr, Q_ptr, S_ptr, i, G, pid_g, rk, mk, off, m2, seg_stride, K, L,
                 BL: tl.constexpr):
    """acc after body i of a factored run: gamma * acc - P^T (Q acc) + S_i (`off`: this program's
    tile of segment 0; P and Q [n, G, L, K], gamma [n, G, K])."""
    s_i = tl.load(S_ptr + i * seg_stride + off, mask=m2, other=0.0).to(tl.float32)
    slice_i = i * G + pid_g
    gam = tl.load(Gam_ptr + slice_i * K + rk, mask=mk, other=0.0).to(tl.float32)
    rl = tl.arange(0, BL)
    ml = rl < L
    base = slice_i * L * K
    q = tl.load(Q_ptr + base + rl[:, None] * K + rk[None, :], mask=ml[:, None] & mk[None, :],
                other=0.0).to(tl.float32)  # [BL, BK]
    pt = tl.load(P_ptr + base + rl[None, :] * K + rk[:, None], mask=mk[:, None] & ml[None, :],
                 other=0.0).to(tl.float32)  # P^T [BK, BL]
    qs = tl.dot(q, acc, input_precision="ieee")  # [BL, BV]
    return acc * gam[:, None] - tl.dot(pt, qs, input_precision="ieee") + s_i


@triton.jit(do_not_specialize=["n", "G", "L"])
def _run_kernel(Ta_ptr, Sa_ptr, Tb_ptr, Sb_ptr, Sin_ptr, Enter_ptr, Out_ptr, Gam_ptr, P_ptr, Q_ptr, n, G, K, V, L,
                FORM: tl.constexpr, HAS_SIN: tl.constexpr, LOWRANK: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, BL: tl.constexpr):
    pid_g = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = pid_v * BV + tl.arange(0, BV)
    mk = rk < K
    m2 = mk[:, None] & (rv < V)[None, :]
    KV = K * V
    off = pid_g * KV + rk[:, None] * V + rv[None, :]  # this slice's tile (segment 0)
    seg_stride = G.to(tl.int64) * KV
    if HAS_SIN:
        acc = tl.load(Sin_ptr + off, mask=m2, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(n):
        tl.store(Enter_ptr + i * seg_stride + off, acc, mask=m2)
        acc = compose_step(acc, Ta_ptr, Sa_ptr, i, G, pid_g, rk, mk, off, m2, seg_stride, K, FORM, BK)
        if LOWRANK:
            acc = lowrank_step(acc, Gam_ptr, P_ptr, Q_ptr, Sb_ptr, i, G, pid_g, rk, mk, off, m2, seg_stride, K, L, BL)
        else:
            acc = compose_step(acc, Tb_ptr, Sb_ptr, i, G, pid_g, rk, mk, off, m2, seg_stride, K, FORM, BK)
    tl.store(Out_ptr + off, acc, mask=m2)


def compose_run_states_triton(Ta, Sa, Tb, Sb, S_in=None, *, form: str | None = None, config: dict | None = None):
    """Triton path of kernels.compose.compose_run_states (same API as the torch reference; Tb a
    tensor or a stacked LowRankT)."""
    form = form or infer_form(Ta, Sa)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}")
    n, G, K, V = check_run_shapes(Ta, Sa, Tb, Sb, S_in, form)
    Gn = math.prod(G)
    flat_T = lambda T: T.reshape((n, Gn) + tuple(T.shape[1 + len(G):])).contiguous()  # noqa: E731
    Sa_c, Sb_c = Sa.reshape(n, Gn, K, V).contiguous(), Sb.reshape(n, Gn, K, V).contiguous()
    Sin = S_in.reshape(Gn, K, V).contiguous() if S_in is not None else None
    entering = torch.empty((n,) + G + (K, V), dtype=torch.float32, device=Sa.device)
    out = torch.empty(G + (K, V), dtype=torch.float32, device=Sa.device)
    cfg = dict(default_config(form, K, V), **(config or {}))
    lowrank = isinstance(Tb, LowRankT)
    if lowrank:
        L = Tb.rank
        gam, P, Q, Tb_c = flat_T(Tb.gamma), flat_T(Tb.P), flat_T(Tb.Q), Sb_c
    else:
        L = 1
        Tb_c = flat_T(Tb)
        gam = P = Q = Sb_c  # unused (LOWRANK off)
    if Gn > 0 and n > 0:
        _run_kernel[(Gn, triton.cdiv(V, cfg["BV"]))](
            flat_T(Ta), Sa_c, Tb_c, Sb_c, Sin if Sin is not None else Sa_c, entering, out, gam, P, Q, n, Gn, K, V, L,
            FORM=_FORM_ID[form], HAS_SIN=Sin is not None, LOWRANK=lowrank, BK=cfg["BK"], BV=cfg["BV"],
            BL=max(16, triton.next_power_of_2(L)), num_warps=cfg["num_warps"],
        )
    elif S_in is not None:
        out.copy_(S_in)
    else:
        out.zero_()
    return entering, out
