"""Linear-attention kernels for every family: naive references, chunked torch paths, fla on GPU.

Public entry points:
    linear_attention(family, q, k, v, *, g=None, beta=None, initial_state=None, scale=None)
        -> (o [B,T,H,V], final state [B,H,K,V] fp32)
    recurrent_step(family, q, k, v, g, beta, state, scale=None) -> (o, new state)   # decode, T = 1
plus the per-family ``naive_*`` / ``chunk_*`` functions and the segment summaries of
:mod:`kernels.linear_attn.summary` (transition operators and their composition).

fla (flash-linear-attention) is used only for CUDA tensors in bf16/fp16 when ``import fla``
succeeds; it is never imported for CPU tensors (on CPU machines fla must not even be installed,
see docs/gpu.md).
"""
from __future__ import annotations

import warnings

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

_fla_state: dict = {}


def _default_scale(name: str, K: int, scale: float | None) -> float:
    if scale is not None:
        return scale
    return 1.0 if _family_row(name).unit_scale else K**-0.5


def fla_available() -> bool:
    """True when fla imports (tried once, only ever called for CUDA tensors)."""
    if "ok" not in _fla_state:
        try:
            import fla  # noqa: F401

            _fla_state["ok"] = True
        except Exception:  # pragma: no cover - depends on the GPU environment
            _fla_state["ok"] = False
    return _fla_state["ok"]


def _fla_call(family, q, k, v, g, beta, initial_state, scale):  # pragma: no cover - GPU only
    S0 = initial_state.float().contiguous() if initial_state is not None else None
    kw = dict(scale=scale, initial_state=S0, output_final_state=True)
    if family in ("retnet", "mamba2"):
        from fla.ops.simple_gla import chunk_simple_gla

        gg = g.float()
        if family == "retnet" and gg.dim() == 1:  # [H]; a per-token [B,T,H] gate passes as is
            B, T, H = q.shape[0], q.shape[1], v.shape[2]
            gg = gg.view(1, 1, H).expand(B, T, H).contiguous()
        o, S = chunk_simple_gla(q, k, v, g=gg, **kw)
    elif family == "gla":
        from fla.ops.gla import chunk_gla as fla_chunk_gla

        o, S = fla_chunk_gla(q, k, v, g=g.float(), **kw)
    elif family == "deltanet":
        from fla.ops.delta_rule import chunk_delta_rule

        o, S = chunk_delta_rule(q, k, v, beta=beta, **kw)
    elif family == "gated_deltanet":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, S = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, **kw)
    else:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        o, S = fla_chunk_kda(q, k, v, g=g.float(), beta=beta, **kw)
    return o, S.float()


def _use_fla(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if backend == "torch":
        return False
    ok = (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == v.dtype
        and q.shape[2] == v.shape[2]
    )
    if backend == "fla":
        if not (ok and fla_available()):
            raise RuntimeError("backend='fla' needs CUDA bf16/fp16 tensors with equal heads and fla installed")
        return True
    return ok and fla_available()


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
    """Chunked prefill of one family: (o [B,T,H,V] in q's dtype, final state [B,H,K,V] fp32).

    backend: "auto" (fla for CUDA bf16/fp16 when it imports, else the torch chunk path),
    "torch" or "fla". Gates as in :mod:`kernels.linear_attn.naive` (log-decays <= 0).
    chunk_size None: :func:`default_chunk_size` (32 for the delta families on CPU, else 64).
    """
    delta = check_inputs(family, g, beta).delta
    scale = _default_scale(family, k.shape[-1], scale)
    if family != "mamba" and _use_fla(backend, q, k, v):  # pragma: no cover - GPU only (no fla mamba v1 kernel)
        try:
            return _fla_call(family, q, k, v, g, beta, initial_state, scale)
        except Exception as e:  # fall back rather than fail a request; say so once
            if backend == "fla":
                raise
            if not _fla_state.get("warned"):
                warnings.warn(f"fla {family} kernel failed ({e!r}); using the torch chunk path")
                _fla_state["warned"] = True
    if chunk_size is None:
        chunk_size = default_chunk_size(family, q.device)
    return chunk_linear_attn(
        q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=delta, chunk_size=chunk_size
    )


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
