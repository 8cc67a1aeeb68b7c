"""Batched composition of segment summaries in torch (the CPU path and the Triton reference).

Shapes (n segments, any batch dims G = (layers, batch, heads, ...) flattened inside):
    T      scalar [n, *G]   vector [n, *G, K]   matrix [n, *G, K, K]
    S      [n, *G, K, V]                        (zero-start end state of every segment)
    S_in   [*G, K, V] or None (zeros)
    ->     S_out [*G, K, V] = T_n(... T_2 (T_1 S_in + S_1) + S_2 ...) + S_n
           and, with return_all, states [n + 1, *G, K, V]: states[0] = S_in, states[i] = the
           state after segment i (the incoming state of segment i + 1).
Accumulation is fp32; outputs are in ``out_dtype`` (default: S_in's dtype, else S's dtype).
"""
from __future__ import annotations

import torch

from kernels.linear_attn.lowrank import LowRankT

FORMS = ("scalar", "vector", "matrix")


def infer_form(T: torch.Tensor, S: torch.Tensor) -> str:
    d = S.dim() - T.dim()
    if d == 2:
        return "scalar"
    if d == 1:
        return "vector"
    if d == 0:
        return "matrix"
    raise ValueError(f"T {tuple(T.shape)} does not fit S {tuple(S.shape)}")


def check_shapes(T, S, S_in, form):
    if S.dim() < 3:
        raise ValueError("S must be [n, *G, K, V]")
    n, K, V = S.shape[0], S.shape[-2], S.shape[-1]
    G = tuple(S.shape[1:-2])
    want = {"scalar": (n,) + G, "vector": (n,) + G + (K,), "matrix": (n,) + G + (K, K)}[form]
    if tuple(T.shape) != want:
        raise ValueError(f"{form} T must be {want}, got {tuple(T.shape)}")
    if S_in is not None and tuple(S_in.shape) != G + (K, V):
        raise ValueError(f"S_in must be {G + (K, V)}, got {tuple(S_in.shape)}")
    return n, G, K, V


def compose_batched_torch(
    T: torch.Tensor,
    S: torch.Tensor,
    S_in: torch.Tensor | None = None,
    *,
    form: str | None = None,
    return_all: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
):
    """Torch path of :func:`kernels.compose.compose_batched` (same API)."""
    form = form or infer_form(T, S)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}")
    n, G, K, V = check_shapes(T, S, S_in, form)
    odt = out_dtype or (S_in.dtype if S_in is not None else S.dtype)
    acc = S_in.float().clone() if S_in is not None else S.new_zeros(G + (K, V), dtype=torch.float32)
    states = None
    if return_all:
        states = torch.empty((n + 1,) + G + (K, V), dtype=odt, device=S.device)
        states[0].copy_(acc)
    for i in range(n):
        Ti = T[i].float()
        if form == "scalar":
            acc.mul_(Ti[..., None, None])
        elif form == "vector":
            acc.mul_(Ti[..., None])
        else:
            acc = torch.matmul(Ti, acc)
        acc.add_(S[i].float())
        if states is not None:
            states[i + 1].copy_(acc)
    if out is not None:
        out.copy_(acc)
        res = out
    else:
        res = acc.to(odt)
    return (res, states) if return_all else res


def check_lowrank_shapes(T: LowRankT, n: int, G: tuple, K: int) -> int:
    """The rank bound L of a stacked low-rank T for a run of n segments: gamma [n, *G, K], P and
    Q [n, *G, L, K]. ValueError otherwise."""
    L = T.P.shape[-2] if T.P.dim() >= 2 else -1
    if tuple(T.gamma.shape) != (n,) + G + (K,) or tuple(T.P.shape) != (n,) + G + (L, K) \
            or tuple(T.Q.shape) != tuple(T.P.shape):
        raise ValueError(f"low-rank T must be gamma {(n,) + G + (K,)}, P and Q {(n,) + G + ('L', K)}; got "
                         f"{tuple(T.gamma.shape)}, {tuple(T.P.shape)}, {tuple(T.Q.shape)}")
    return L


def check_run_shapes(Ta, Sa, Tb, Sb, S_in, form):
    """(n, G, K, V) of a run: seam summaries (Ta, Sa) in `form`, body summaries (Tb, Sb) in `form`
    or, for the matrix form, Tb a stacked kernels.linear_attn.lowrank.LowRankT."""
    n, G, K, V = check_shapes(Ta, Sa, S_in, form)
    if isinstance(Tb, LowRankT):
        if form != "matrix":
            raise ValueError(f"a low-rank body T needs the matrix form, not {form!r}")
        check_shapes(Ta, Sb, S_in, form)  # Sb against the seams' shapes: the same [n, *G, K, V]
        check_lowrank_shapes(Tb, n, G, K)
    else:
        check_shapes(Tb, Sb, S_in, form)
    return n, G, K, V


def compose_run_states_torch(Ta: torch.Tensor, Sa: torch.Tensor, Tb: torch.Tensor | LowRankT, Sb: torch.Tensor,
                             S_in: torch.Tensor | None = None, *, form: str | None = None):
    """A run of n segments, each a seam summary (Ta, Sa) followed by a body summary (Tb, Sb), all
    [n, *G, ...] as in compose_batched (Tb may be a stacked LowRankT, kernels.linear_attn.lowrank
    .stack_transitions, applied from its factors): returns (entering [n, *G, K, V] fp32: the state
    entering each segment's seam, S_out [*G, K, V] fp32: the state after the last body). The plain
    reference of kernels.compose.triton_run (one launch for the whole run)."""
    form = form or infer_form(Ta, Sa)
    n, G, K, V = check_run_shapes(Ta, Sa, Tb, Sb, S_in, form)
    acc = S_in.float().clone() if S_in is not None else Sa.new_zeros(G + (K, V), dtype=torch.float32)
    entering = torch.empty((n,) + G + (K, V), dtype=torch.float32, device=Sa.device)
    for i in range(n):
        entering[i].copy_(acc)
        acc = compose_batched_torch(Ta[i : i + 1], Sa[i : i + 1], acc, form=form, out_dtype=torch.float32)
        if isinstance(Tb, LowRankT):
            acc = Tb.select(i).float().apply(acc).add_(Sb[i].float())
        else:
            acc = compose_batched_torch(Tb[i : i + 1], Sb[i : i + 1], acc, form=form, out_dtype=torch.float32)
    return entering, acc
