"""Batched composition of segment summaries: S_out = T_n(...(T_1 S_in + S_1)...) + S_n.

``compose_batched`` runs the Triton kernel for CUDA tensors (when triton imports) and the torch
path otherwise; both share one API (see :mod:`kernels.compose.torch_ref` for shapes). Which one
is decided in one place, :func:`compose_backend`. Triton is imported only when a CUDA tensor
asks for it. ``compose_summary`` is the one-segment form common.engine.pic composes with.
"""
from __future__ import annotations

import torch

from kernels.linear_attn.lowrank import LowRankT

from .torch_ref import FORMS, compose_batched_torch, compose_run_states_torch, infer_form


# state dtypes the Triton kernel is built and tested for (fp32 accumulation inside)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_triton_state: dict = {}


def triton_available() -> bool:
    """True when triton imports (tried once, only ever asked for CUDA tensors)."""
    if "ok" not in _triton_state:
        try:
            import triton  # noqa: F401

            _triton_state["ok"] = True
        except Exception:  # pragma: no cover - depends on the environment
            _triton_state["ok"] = False
    return _triton_state["ok"]


def compose_backend(device: torch.device | str, dtype: torch.dtype, triton_ok: bool | None = None) -> str:
    """The composition path for states on `device` in `dtype`: "triton" on CUDA (fp32/bf16/fp16
    states, triton importable), "torch" otherwise. `triton_ok` None asks :func:`triton_available`."""
    if torch.device(device).type != "cuda" or dtype not in TRITON_DTYPES:
        return "torch"
    return "triton" if (triton_available() if triton_ok is None else triton_ok) else "torch"


def compose_batched(
    T: torch.Tensor,
    S: torch.Tensor,
    S_in: torch.Tensor | None = None,
    *,
    form: str | None = None,
    return_all: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Compose n segments for every (layer, batch, head) slice at once.

    T: scalar [n, *G], vector [n, *G, K] or matrix [n, *G, K, K]; S [n, *G, K, V]; S_in
    [*G, K, V] or None. Returns S_out [*G, K, V] (and the [n + 1, *G, K, V] boundary states with
    ``return_all``). backend: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        backend = compose_backend(S.device, S.dtype)
    if backend == "triton":
        from .triton_compose import compose_batched_triton

        return compose_batched_triton(
            T, S, S_in, form=form, return_all=return_all, out_dtype=out_dtype, out=out
        )
    return compose_batched_torch(T, S, S_in, form=form, return_all=return_all, out_dtype=out_dtype, out=out)


def compose_run_states(Ta, Sa, Tb, Sb, S_in=None, *, form: str | None = None, backend: str = "auto"):
    """A run of n segments, seam summary (Ta, Sa) then body summary (Tb, Sb) each, in one pass:
    (states entering each seam [n, *G, K, V], state after the run [*G, K, V]), fp32. Tb may be a
    stacked kernels.linear_attn.lowrank.LowRankT (matrix form; `stack_transitions`), applied from
    its factors. One Triton launch on CUDA (kernels.compose.triton_run), the torch reference otherwise."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        backend = compose_backend(Sa.device, Sa.dtype)
    if backend == "triton":
        from .triton_run import compose_run_states_triton

        return compose_run_states_triton(Ta, Sa, Tb, Sb, S_in, form=form)
    return compose_run_states_torch(Ta, Sa, Tb, Sb, S_in, form=form)


def compose_summary(summary, S_in: torch.Tensor) -> torch.Tensor:
    """S_out = T . S_in + S (fp32) for one segment's Summary (kernels.linear_attn), on the path
    :func:`compose_backend` picks: the Triton kernel on CUDA, torch (the same arithmetic as
    kernels.linear_attn.compose) on CPU. A low-rank T (kernels.linear_attn.lowrank.LowRankT)
    is applied from its factors on every device (a few batched matmuls; T is never formed)."""
    if isinstance(summary.T, LowRankT):
        S = summary.S.float()
        return S.clone() if S_in is None else summary.T.float().apply(S_in.float()).add_(S)
    return compose_batched(summary.T.unsqueeze(0), summary.S.unsqueeze(0), S_in, form=summary.form,
                           out_dtype=torch.float32)


def stack_summaries(summaries) -> tuple[torch.Tensor, torch.Tensor, str]:
    """[Summary, ...] (one per segment, same shapes) -> (T [n, ...], S [n, ...], form)."""
    forms = {s.form for s in summaries}
    if len(forms) != 1:
        raise ValueError("summaries of mixed forms")
    return torch.stack([s.T for s in summaries]), torch.stack([s.S for s in summaries]), forms.pop()


__all__ = [
    "FORMS", "TRITON_DTYPES", "compose_backend", "compose_batched", "compose_batched_torch", "compose_run_states",
    "compose_run_states_torch", "compose_summary",
    "infer_form", "stack_summaries", "triton_available",
]
