"""Which kernel runs a linear layer (fla or our torch chunk path), and our calls into fla.

One decision, from the device and the dtype the layer computes in (:func:`kernel_path`): fla's
chunk kernels (prefill) and fused recurrent kernels (decode) for CUDA tensors in bf16 or fp16
when ``import fla`` succeeds; our torch chunk path everywhere else. fla is never imported for
CPU tensors: on CPU machines it must not even be installed (transformers binds its Triton
kernels whenever it imports, and they need a GPU driver).

Mixers hand q, k (and Mamba2's v) to the kernels in :func:`operand_dtype`: the model's dtype on
the fla path (fla takes q, k, v, beta in one dtype, gates and the state in fp32, as fla's own
layers call it), fp32 on the torch path, which computes in fp32 anyway, so CPU numbers are the
same as before the fla path was live.

The segment summary (T, S(C|0)) on the fla path comes from the same fla chunk kernel: for the
delta families the value columns are augmented with K columns started at the identity and fed
zero values (exactly what our torch path does, :func:`kernels.linear_attn.chunk.chunk_with_transition`),
so the extra columns of fla's final state are T; for the scalar / per-channel decays T is
exp(sum g), computed in torch beside the kernel. fla has no kernel that returns T by itself.
"""
from __future__ import annotations

import importlib
import warnings

import torch

from .families import DELTA_FAMILIES, FAMILIES

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Families whose fla 0.6 kernels (chunk and fused recurrent) take fewer q/k heads than value
# heads as they are (GVA, HV a multiple of H); for the others q/k are repeated to the value heads.
FLA_GROUPED = frozenset({"gated_deltanet", "kda"})
# the families fla has kernels for (no Mamba v1: it always runs our torch path)
FLA_FAMILIES = tuple(f for f in FAMILIES if f != "mamba")
# exp of log-decays below this is zero for every purpose (as the torch chunk path clamps)
_EXP_FLOOR = -80.0

_fla_state: dict = {}


def fla_available() -> bool:
    """True when fla imports (tried once, only ever called for CUDA tensors)."""
    if "ok" not in _fla_state:
        try:
            import fla  # noqa: F401

            _fla_state["ok"] = True
        except Exception:  # pragma: no cover - depends on the GPU environment
            _fla_state["ok"] = False
    return _fla_state["ok"]


def kernel_path(device, dtype: torch.dtype, *, fla_importable=None) -> str:
    """The one place that picks the path: "fla" (CUDA, bf16/fp16, fla imports) or "torch".

    ``fla_importable`` (tests only) stands in for :func:`fla_available`; it is consulted only
    when device and dtype already qualify, so CPU tensors never trigger ``import fla``."""
    if torch.device(device).type != "cuda" or dtype not in HALF_DTYPES:
        return "torch"
    ok = fla_available() if fla_importable is None else fla_importable
    return "fla" if ok else "torch"


def operand_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """Dtype in which a mixer hands q, k to the kernels: the model's on fla, else fp32."""
    return dtype if kernel_path(device, dtype) == "fla" else torch.float32


def use_fla(backend: str, v: torch.Tensor) -> bool:
    """linear_attention's backend argument ("auto", "torch", "fla") against :func:`kernel_path`
    of v (the model's dtype: q and k are cast to it on the fla path)."""
    if backend == "torch":
        return False
    ok = kernel_path(v.device, v.dtype) == "fla"
    if backend == "fla" and not ok:
        raise RuntimeError("backend='fla' needs CUDA bf16/fp16 tensors and fla installed")
    return ok


def run_with_fallback(backend: str, family: str, fla_fn, torch_fn):
    """fla_fn() unless it raises: then torch_fn() (backend "auto"; warned once) or the error."""
    try:
        return fla_fn()
    except Exception as e:
        if backend == "fla":
            raise
        if not _fla_state.get("warned"):
            warnings.warn(f"fla {family} kernel failed ({e!r}); using the torch chunk path")
            _fla_state["warned"] = True
    return torch_fn()


# -- operands as fla wants them ---------------------------------------------------------------
def _operands(family, q, k, v, g, beta):
    """q, k, beta in v's dtype, q/k repeated to the value heads where fla has no GVA for the
    family, gates fp32 (per-head constant retnet gate stays [H] for g_gamma)."""
    dt = v.dtype
    q, k = q.to(dt), k.to(dt)
    if q.shape[-2] != v.shape[-2] and family not in FLA_GROUPED:
        rep = v.shape[-2] // q.shape[-2]
        q, k = q.repeat_interleave(rep, -2), k.repeat_interleave(rep, -2)
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.to(dt).contiguous()
    return q.contiguous(), k.contiguous(), v.contiguous(), g, beta


def _state(S: torch.Tensor | None) -> torch.Tensor | None:
    return None if S is None else S.float().contiguous()


# family -> (fla module, its chunked op, its fused recurrent op); imported when first called
_FLA_OPS = {
    "retnet": ("fla.ops.simple_gla", "chunk_simple_gla", "fused_recurrent_simple_gla"),
    "mamba2": ("fla.ops.simple_gla", "chunk_simple_gla", "fused_recurrent_simple_gla"),
    "gla": ("fla.ops.gla", "chunk_gla", "fused_recurrent_gla"),
    "deltanet": ("fla.ops.delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule"),
    "gated_deltanet": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "kda": ("fla.ops.kda", "chunk_kda", "fused_recurrent_kda"),
}


def _fla_op(family: str, recurrent: bool):
    module, chunked_name, recurrent_name = _FLA_OPS[family]
    return getattr(importlib.import_module(module), recurrent_name if recurrent else chunked_name)


def _call(fn, family, q, k, v, g, beta, S0, scale):
    """One fla call with each family's keyword names; returns (o, final state fp32)."""
    kw = dict(scale=scale, initial_state=S0, output_final_state=True)
    if family == "retnet" and g.dim() == 1:  # [H]; a per-token [B,T,H] gate (lightning's padded seams) is g
        kw["g_gamma"] = g
    elif family in ("retnet", "mamba2"):
        kw["g"] = g
    elif family == "gla":
        kw["gk" if "recurrent" in fn.__name__ else "g"] = g
    elif family in ("gated_deltanet", "kda"):
        kw["g"] = g
    if family in DELTA_FAMILIES:
        kw["beta"] = beta
    o, S = fn(q, k, v, **kw)
    return o, S.float()


# -- the three calls ----------------------------------------------------------------------------
def fla_chunk(family, q, k, v, g, beta, initial_state, scale):
    """Prefill through fla's chunk kernel: (o [B,T,HV,V] in v's dtype, final state fp32)."""
    q, k, v, g, beta = _operands(family, q, k, v, g, beta)
    return _call(_fla_op(family, recurrent=False), family, q, k, v, g, beta, _state(initial_state), scale)


def fla_recurrent_step(family, q, k, v, g, beta, state, scale):
    """One decode token through fla's fused recurrent kernel. q, k [B,H,K], v [B,HV,V], g [H],
    [B,HV] or [B,HV,K], beta [B,HV], state [B,HV,K,V] (left untouched). Returns (o [B,HV,V], S)."""
    if g is not None and g.dim() >= 2:
        g = g.unsqueeze(1)
    if beta is not None:
        beta = beta.unsqueeze(1)
    q, k, v, g, beta = _operands(family, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g, beta)
    # fla 0.6's fused recurrent kernels write a fresh final state (the interpreter test checks)
    o, S = _call(_fla_op(family, recurrent=True), family, q, k, v, g, beta, _state(state), scale)
    return o[:, 0], S


def fla_chunk_with_transition(family, q, k, v, g, beta, initial_state, scale):
    """(o or None, end state, T) from fla's chunk kernel, as chunk_with_transition gives them.

    Delta families: the value columns carry K extra columns started at the identity and fed
    zeros, so the final state's extra columns are T [B,HV,K,K]. Others: T = exp(sum g) in torch
    ([B,HV] or [B,HV,K]) beside one plain fla call."""
    B, L, HV, V = v.shape
    K = k.shape[-1]
    qq = k if q is None else q
    if family in DELTA_FAMILIES:
        eye = torch.eye(K, device=v.device).expand(B, HV, K, K)
        S0 = initial_state.float() if initial_state is not None else v.new_zeros(B, HV, K, V, dtype=torch.float32)
        v_aug = torch.cat([v, v.new_zeros(B, L, HV, K)], -1)
        o, S = fla_chunk(family, qq, k, v_aug, g, beta, torch.cat([S0, eye], -1), scale)
        return (None if q is None else o[..., :V].contiguous()), S[..., :V].contiguous(), S[..., V:].contiguous()
    o, S = fla_chunk(family, qq, k, v, g, beta, initial_state, scale)
    return (None if q is None else o), S, decay_product(family, g, B, L, HV)


def decay_product(family, g, B, L, HV) -> torch.Tensor:
    """T of the scalar / per-channel families: exp(sum_t g_t), [B,HV] or [B,HV,K] fp32."""
    if family == "retnet" and g.dim() == 1:  # g [H]: one log-decay per head, every token
        tot = (g.double() * L).view(1, HV).expand(B, HV)
    else:
        tot = g.double().sum(1)
    return tot.clamp(min=_EXP_FLOOR).exp().float().contiguous()
