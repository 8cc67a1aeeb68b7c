"""Triton kernel: batched composition of segment summaries over (segments, layers, heads).

One program owns one (layer*head*batch) slice g and one BV-wide tile of the value dimension; it
keeps the [K, BV] state tile in fp32 registers and walks the n segments in order:

    scalar  acc = t_i * acc + S_i
    vector  acc = t_i[:, None] * acc + S_i
    matrix  acc = T_i @ acc + S_i          (tl.dot with input_precision="ieee": exact fp32)

so every state element is read once per segment and the running state never leaves the chip.
Same API as :func:`kernels.compose.torch_ref.compose_batched_torch`. Fixed configs (no
autotune), so the kernel also runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .torch_ref import FORMS, check_shapes, infer_form

_FORM_ID = {"scalar": 0, "vector": 1, "matrix": 2}


@triton.jit
def compose_step(acc, T_ptr, S_ptr, i, G, pid_g, rk, mk, off, m2, seg_stride, K, FORM: tl.constexpr, BK: tl.constexpr):
    """acc after summary i of (T_ptr, S_ptr) (`off`: this program's tile of segment 0): one step of
    every composition kernel (this file's and triton_run's)."""
    s_i = tl.load(S_ptr + i * seg_stride + off, mask=m2, other=0.0).to(tl.float32)
    if FORM == 0:
        t = tl.load(T_ptr + i * G + pid_g).to(tl.float32)
        acc = acc * t + s_i
    elif FORM == 1:
        t = tl.load(T_ptr + (i * G + pid_g) * K + rk, mask=mk, other=0.0).to(tl.float32)
        acc = acc * t[:, None] + s_i
    else:
        tt = tl.load(T_ptr + (i * G + pid_g) * K * K + rk[:, None] * K + rk[None, :],
                     mask=mk[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(tt, acc, input_precision="ieee") + s_i
    return acc


@triton.jit(do_not_specialize=["n", "G"])
def _compose_kernel(
    T_ptr,
    S_ptr,
    Sin_ptr,
    Out_ptr,
    States_ptr,
    n,
    G,
    K,
    V,
    FORM: tl.constexpr,
    HAS_SIN: tl.constexpr,
    STORE_ALL: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    pid_g = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = pid_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m2 = mk[:, None] & mv[None, :]
    off = rk[:, None] * V + rv[None, :]
    KV = K * V
    seg_stride = G.to(tl.int64) * KV  # elements between segment i and i + 1 in S / States
    base = pid_g * KV
    if HAS_SIN:
        acc = tl.load(Sin_ptr + base + off, mask=m2, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BK, BV], dtype=tl.float32)
    if STORE_ALL:
        tl.store(States_ptr + base + off, acc.to(States_ptr.dtype.element_ty), mask=m2)
    for i in range(n):
        acc = compose_step(acc, T_ptr, S_ptr, i, G, pid_g, rk, mk, base + off, m2, seg_stride, K, FORM, BK)
        if STORE_ALL:
            tl.store(States_ptr + (i + 1) * seg_stride + base + off, acc.to(States_ptr.dtype.element_ty), mask=m2)
    tl.store(Out_ptr + base + off, acc.to(Out_ptr.dtype.element_ty), mask=m2)


def default_config(form: str, K: int, V: int) -> dict:
    BK = max(16, triton.next_power_of_2(K))
    if form == "matrix":
        BV = max(16, min(triton.next_power_of_2(V), 32 if BK >= 128 else 64))
        num_warps = 8 if BK >= 128 else 4
    else:
        BV = max(16, min(triton.next_power_of_2(V), 128))
        num_warps = 4
    return dict(BK=BK, BV=BV, num_warps=num_warps)


def compose_batched_triton(
    T: torch.Tensor,
    S: torch.Tensor,
    S_in: torch.Tensor | None = None,
    *,
    form: str | None = None,
    return_all: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
):
    """Triton path of :func:`kernels.compose.compose_batched` (same API; ``config`` overrides
    BK / BV / num_warps)."""
    form = form or infer_form(T, S)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}")
    n, G, K, V = check_shapes(T, S, S_in, form)
    Gn = math.prod(G)
    odt = out_dtype or (S_in.dtype if S_in is not None else S.dtype)
    Tc = T.reshape((n, Gn) + tuple(T.shape[1 + len(G):])).contiguous()
    Sc = S.reshape(n, Gn, K, V).contiguous()
    Sin = S_in.reshape(Gn, K, V).contiguous() if S_in is not None else None
    if out is not None:
        if tuple(out.shape) != G + (K, V) or not out.is_contiguous():
            raise ValueError("out must be a contiguous [*G, K, V] tensor")
        res = out
    else:
        res = torch.empty(G + (K, V), dtype=odt, device=S.device)
    states = torch.empty((n + 1,) + G + (K, V), dtype=odt, device=S.device) if return_all else res
    cfg = dict(default_config(form, K, V), **(config or {}))
    grid = (Gn, triton.cdiv(V, cfg["BV"]))
    if Gn > 0:
        _compose_kernel[grid](
            Tc, Sc, Sin if Sin is not None else Sc, res, states,
            n, Gn, K, V,
            FORM=_FORM_ID[form], HAS_SIN=Sin is not None, STORE_ALL=return_all,
            BK=cfg["BK"], BV=cfg["BV"], num_warps=cfg["num_warps"], enable_fp_fusion=True,
        )
    return (res, states) if return_all else res
