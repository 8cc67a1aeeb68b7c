"""Linear-attention kernels for every family: naive references, chunked torch paths, fla on GPU.

Public entry points:
    linear_attention(family, q, k, v, *, g=None, beta=None, initial_state=None, scale=None)
        -> (o [B,T,H,V], final state [B,H,K,V] fp32)
    recurrent_step(family, q, k, v, g, beta, state, scale=None) -> (o, new state)   # decode, T = 1
plus the per-family ``naive_*`` / ``chunk_*`` functions and the segment summaries of
:mod:`kernels.linear_attn.summary` (transition operators and their composition).

fla (flash-linear-attention) is used only for CUDA tensors in bf16/fp16 when ``import fla``
succeeds; it is never imported for CPU tensors (on CPU machines fla must not even be installed).
:mod:`kernels.linear_attn.fla_path` decides the path (``kernel_path``) and holds the fla calls.
"""
from __future__ import annotations

import torch

from .chunk import (
    chunk_deltanet,
    chunk_gated_deltanet,
    chunk_gla,
    chunk_kda,
    chunk_linear_attn,
    chunk_mamba2,
    chunk_retnet,
    chunk_with_transition,
    default_chunk_size,
    identity_transition,
)
from .families import DELTA_FAMILIES, FAMILIES, FAMILY, FAMILY_GATE, Family, check_inputs
from .families import family as _family_row
from .fla_path import (
    FLA_FAMILIES,
    fla_available,
    fla_chunk,
    fla_recurrent_step,
    kernel_path,
    operand_dtype,
    run_with_fallback,
    use_fla,
)
from .naive import (
    expand_gate,
    naive_deltanet,
    naive_gated_deltanet,
    naive_gla,
    naive_kda,
    naive_mamba2,
    naive_recurrent,
    naive_retnet,
)
from .segments import segment_states, segment_states_reference
from .mamba import chunk_mamba, mamba_features, naive_mamba, naive_selective_scan
from .summary import (
    Summary,
    compose,
    compose_chain,
    merge,
    naive_add,
    prefill_with_summary,
    rerotate,
    segment_summary,
    summary_form,
)



def _default_scale(name: str, K: int, scale: float | None) -> float:
    if scale is not None:
        return scale
    return 1.0 if _family_row(name).unit_scale else K**-0.5


def linear_attention(
    family: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill of one family: (o [B,T,H,V] in q's dtype (v's on fla), final state [B,H,K,V] fp32).

    backend: "auto" (fla for CUDA bf16/fp16 when it imports, else the torch chunk path),
    "torch" or "fla". Gates as in :mod:`kernels.linear_attn.naive` (log-decays <= 0).
    chunk_size None: :func:`default_chunk_size` (32 for the delta families on CPU, else 64).
    """
    delta = check_inputs(family, g, beta).delta
    scale = _default_scale(family, k.shape[-1], scale)
    if chunk_size is None:
        chunk_size = default_chunk_size(family, q.device)

    def torch_path():
        return chunk_linear_attn(
            q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=delta, chunk_size=chunk_size
        )

    if family in FLA_FAMILIES and use_fla(backend, v) and q.shape[1] > 0:
        return run_with_fallback(
            backend, family, lambda: fla_chunk(family, q, k, v, g, beta, initial_state, scale), torch_path
        )
    return torch_path()


def recurrent_step(
    family: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (T = 1) of any family.

    q, k [B,H,K] or [B,1,H,K]; v [B,H,V] or [B,1,H,V]; g: [H], [B,H] / [B,1,H] (per head) or
    [B,H,K] / [B,1,H,K] (per channel); beta [B,H] or [B,1,H]; state [B,H,K,V].
    Returns (o shaped like v, in q's dtype; new state fp32). The input state is left untouched
    unless ``out_state`` is it (in-place update; any [B,H,K,V] fp32 buffer works).
    """
    delta = _family_row(family).delta
    if state is None:
        raise ValueError("recurrent_step needs the state [B,H,K,V]")
    if delta and beta is None:
        raise ValueError(f"{family} needs beta")
    tok = q.dim() == 4
    if tok:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        if g is not None and g.dim() >= 3 and g.shape[1] == 1:
            g = g[:, 0]
        if beta is not None and beta.dim() == 3:
            beta = beta[:, 0]
    if family in FLA_FAMILIES and kernel_path(v.device, v.dtype) == "fla":
        o, S = run_with_fallback(
            "auto", family,
            lambda: fla_recurrent_step(family, q, k, v, g, beta, state, _default_scale(family, k.shape[-1], scale)),
            lambda: recurrent_step(family, q.float(), k.float(), v.float(), g, beta, state, scale),
        )
        o = o.to(v.dtype)
        if out_state is not None:
            S = out_state.copy_(S)
        return (o.unsqueeze(1) if tok else o), S
    B, H, K = k.shape
    if q.shape[1] != v.shape[1]:  # grouped value heads
        rep = v.shape[1] // q.shape[1]
        q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
        H = v.shape[1]
    scale = _default_scale(family, K, scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    S = state.float()
    if g is not None:
        gf = g.float()
        if gf.dim() == 1:
            dec = gf.exp().view(1, H, 1, 1)
        elif gf.dim() == 2:
            dec = gf.exp().view(B, H, 1, 1)
        else:
            dec = gf.exp().unsqueeze(-1)
        S = torch.mul(S, dec, out=out_state) if out_state is not None else S * dec
    elif out_state is not None and out_state is not state:
        out_state.copy_(S)
        S = out_state
    elif out_state is None:
        S = S.clone() if S is state else S
    if delta:
        pred = torch.matmul(kf.unsqueeze(-2), S).squeeze(-2)  # [B,H,V]
        upd = (vf - pred) * beta.float().unsqueeze(-1)
    else:
        upd = vf * beta.float().unsqueeze(-1) if beta is not None else vf
    S.add_(kf.unsqueeze(-1) * upd.unsqueeze(-2))
    o = torch.matmul((qf * scale).unsqueeze(-2), S).squeeze(-2).to(q.dtype)
    if tok:
        o = o.unsqueeze(1)
    return o, S


__all__ = [
    "FAMILIES",
    "DELTA_FAMILIES",
    "FAMILY",
    "FAMILY_GATE",
    "Family",
    "check_inputs",
    "identity_transition",
    "expand_gate",
    "naive_recurrent",
    "naive_retnet",
    "naive_mamba2",
    "naive_gla",
    "naive_deltanet",
    "naive_gated_deltanet",
    "naive_kda",
    "chunk_linear_attn",
    "chunk_with_transition",
    "default_chunk_size",
    "segment_states",
    "segment_states_reference",
    "chunk_retnet",
    "chunk_mamba2",
    "chunk_gla",
    "chunk_deltanet",
    "chunk_gated_deltanet",
    "chunk_kda",
    "naive_mamba",
    "chunk_mamba",
    "naive_selective_scan",
    "mamba_features",
    "linear_attention",
    "recurrent_step",
    "fla_available",
    "kernel_path",
    "operand_dtype",
    "Summary",
    "segment_summary",
    "prefill_with_summary",
    "summary_form",
    "compose",
    "compose_chain",
    "merge",
    "naive_add",
    "rerotate",
]
