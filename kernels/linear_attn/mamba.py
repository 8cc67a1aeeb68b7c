"""Mamba (v1) selective scan as the seventh linear-attention family, "mamba".

Mamba v1 keeps one state row h[d] in R^N per channel d of the inner dimension D, with a decay
that depends on the channel AND the state index (A [D, N]) and a step size per channel (dt):

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] u_t[d]
    y_t[d]    = sum_n C_t[n] h_t[d, n]                      (+ D[d] u_t[d], z gate: the mixer's)

In the family contract of :mod:`kernels.linear_attn.naive` this is the per-channel-gated plain
recurrence with one head per inner channel and a value width of 1:

    H = D, K = N, V = 1:   q = C, k = B (the same for every head), v = dt*u [.., D, 1],
                           g = dt*A [B, T, D, N] (per key channel), scale = 1

so the chunked path is the per-channel-gate chunk path (:func:`chunk_linear_attn`, exact
overflow-free block scoring) and a segment's transition operator is diagonal, T[d, n] =
exp(sum_t dt_t[d] A[d, n]) — "vector" form [B, D, N], one number per channel x state, composing
exactly (:func:`kernels.linear_attn.compose`).

:func:`naive_selective_scan` is the reference in Mamba's own layout (u [B,T,D], dt, A, B, C),
written literally from the formula above; :func:`naive_mamba` is the same loop in the family
contract (it is :func:`naive_recurrent`), so the tests tie the two layouts together.
"""
from __future__ import annotations

import torch

from .chunk import chunk_linear_attn, default_chunk_size
from .naive import naive_recurrent


def mamba_features(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
    """Mamba's layout -> the family contract (q, k, v, g), fp32.

    u, dt [Bs, T, D]; A [D, N] (negative); B, C [Bs, T, N]. q and k are expanded views (no copy)
    to D heads; v [Bs, T, D, 1]; g = dt*A [Bs, T, D, N]."""
    Bs, T, D = u.shape
    N = A.shape[-1]
    dtf = dt.float()
    q = C.float()[:, :, None, :].expand(Bs, T, D, N)
    k = B.float()[:, :, None, :].expand(Bs, T, D, N)
    v = (dtf * u.float()).unsqueeze(-1)
    g = dtf.unsqueeze(-1) * A.float()
    return q, k, v, g


def naive_selective_scan(u, dt, A, B, C, initial_state=None):
    """Literal Mamba v1 recurrence (no D skip, no gate): (y [Bs,T,D] fp32, h [Bs,D,N] fp32)."""
    Bs, T, D = u.shape
    N = A.shape[-1]
    h = torch.zeros(Bs, D, N, dtype=torch.float32, device=u.device)
    if initial_state is not None:
        h = h + initial_state.float()
    y = torch.empty(Bs, T, D, dtype=torch.float32, device=u.device)
    A, u, dt, B, C = A.float(), u.float(), dt.float(), B.float(), C.float()
    for t in range(T):
        dA = torch.exp(dt[:, t, :, None] * A)  # [Bs, D, N]
        dBu = dt[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        h = dA * h + dBu
        y[:, t] = (h * C[:, t, None, :]).sum(-1)
    return y, h


def naive_mamba(q, k, v, g, initial_state=None, scale=1.0):
    """Mamba v1 in the family contract: g [B,T,D,N] per channel, v [B,T,D,1], state [B,D,N,1]."""
    return naive_recurrent(q, k, v, g=g, initial_state=initial_state, scale=scale)


def chunk_mamba(q, k, v, g, initial_state=None, scale=1.0):
    """Chunked Mamba v1 (the per-channel-gate chunk path)."""
    return chunk_linear_attn(q, k, v, g=g, initial_state=initial_state, scale=scale,
                             chunk_size=default_chunk_size(False, k.device))


__all__ = ["mamba_features", "naive_selective_scan", "naive_mamba", "chunk_mamba"]
