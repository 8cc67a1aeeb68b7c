"""Batched composition of segment summaries: S_out = T_n(...(T_1 S_in + S_1)...) + S_n.

``compose_batched`` runs the Triton kernel for CUDA tensors (when triton imports) and the torch
path otherwise; both share one API (see :mod:`kernels.compose.torch_ref` for shapes). Triton is
imported only when a CUDA tensor asks for it.
"""
from __future__ import annotations

import torch

from .torch_ref import FORMS, compose_batched_torch, infer_form


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:  # pragma: no cover
        return False


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
    use_triton = backend == "triton" or (backend == "auto" and S.is_cuda and _triton_ok())
    if use_triton:
        from .triton_compose import compose_batched_triton

        return compose_batched_triton(
            T, S, S_in, form=form, return_all=return_all, out_dtype=out_dtype, out=out
        )
    return compose_batched_torch(T, S, S_in, form=form, return_all=return_all, out_dtype=out_dtype, out=out)


def stack_summaries(summaries) -> tuple[torch.Tensor, torch.Tensor, str]:
    """[Summary, ...] (one per segment, same shapes) -> (T [n, ...], S [n, ...], form)."""
    forms = {s.form for s in summaries}
    if len(forms) != 1:
        raise ValueError("summaries of mixed forms")
    return torch.stack([s.T for s in summaries]), torch.stack([s.S for s in summaries]), forms.pop()


__all__ = ["FORMS", "compose_batched", "compose_batched_torch", "infer_form", "stack_summaries"]
