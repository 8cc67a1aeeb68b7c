"""Segment summaries: transition operators and their composition (docs/design.md §2).

For a segment C = (t_1 .. t_n) of a linear layer, with S_t = A_t S_{t-1} + (write of token t):

    T_C = A_{t_n} ... A_{t_1}        S(C | S_0) = T_C . S_0 + S(C | 0)

and so S(C1 C2) = T_{C2} . S(C1) + S(C2 | 0). ``Summary`` keeps (T_C, S(C|0)) with T in its
structured form, fp32:

    form      families                          T shape
    scalar    retnet, mamba2 (and no gate)      [B, H]          T = exp(sum g)
    vector    gla, mamba (v1: H = inner channels) [B, H, K]     T = exp(sum g) per channel
    matrix    deltanet, gated_deltanet, kda     [B, H, K, K]    acts on S [K, V] from the left

A matrix T may also be held as a kernels.linear_attn.lowrank.LowRankT (diag(gamma) - P^T Q, the
factors of a segment shorter than half the key dimension): ``compose`` applies it without forming
T; ``merge`` and ``rerotate`` form it first (neither is on an entry's path).

The matrix T is computed chunk-wise in the same pass as S: the chunked recurrence runs on the
state augmented with K columns started at the identity and fed zero values, sharing the UT
transform (``chunk_with_transition``), never by a per-token K x K product loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunk import chunk_with_transition, default_chunk_size, identity_transition
from .families import check_inputs, family
from .families import FAMILY
from .fla_path import FLA_FAMILIES, fla_chunk_with_transition, kernel_path, run_with_fallback
from .lowrank import LowRankT

_FORMS = ("scalar", "vector", "matrix")


def summary_form(name: str) -> str:
    """The form of the family's transition T (see kernels.linear_attn.families)."""
    return family(name).form


@dataclass
class Summary:
    """(T, S) of one segment of one linear layer; ``form`` in {"scalar", "vector", "matrix"}."""

    T: torch.Tensor
    S: torch.Tensor
    form: str

    def __post_init__(self):
        if self.form not in _FORMS:
            raise ValueError(f"form must be one of {_FORMS}, got {self.form!r}")

    def to(self, *args, **kwargs) -> "Summary":
        return Summary(self.T.to(*args, **kwargs), self.S.to(*args, **kwargs), self.form)

    @property
    def nbytes(self) -> int:
        return self.T.numel() * self.T.element_size() + self.S.numel() * self.S.element_size()


def segment_summary(
    family: str,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> Summary:
    """(T_C, S(C|0)) of the segment given by k [B,T,H,K], v [B,T,H,V] and its gates (fp32 out)."""
    f = check_inputs(family, g, beta)
    chunk_size = chunk_size or default_chunk_size(family, k.device)
    _, S, T = _with_transition(family, None, k, v, g, beta, None, None, chunk_size)
    return Summary(T.float(), S, f.form)


def _with_transition(family, q, k, v, g, beta, initial_state, scale, chunk_size):
    """(o, S, T) in one pass: fla's chunk kernel where :func:`kernel_path` says fla, else ours."""
    def torch_path():
        return chunk_with_transition(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale,
                                     delta=FAMILY[family].delta, chunk_size=chunk_size)

    if family in FLA_FAMILIES and kernel_path(v.device, v.dtype) == "fla" and k.shape[1] > 0:
        if scale is None:
            scale = 1.0 if FAMILY[family].unit_scale else k.shape[-1] ** -0.5
        return run_with_fallback(
            "auto", family,
            lambda: fla_chunk_with_transition(family, q, k, v, g, beta, initial_state, scale), torch_path,
        )
    return torch_path()


def prefill_with_summary(
    family: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Summary]:
    """Prefill and summary in one pass: (o, end state from ``initial_state``, Summary(T, S(C|0))).

    With ``initial_state`` None the end state is S(C|0) itself. Otherwise S(C|0) is recovered as
    end - T . initial_state (exact up to rounding).
    """
    f = check_inputs(family, g, beta)
    if scale is None and f.unit_scale:
        scale = 1.0
    chunk_size = chunk_size or default_chunk_size(family, k.device)
    o, S, T = _with_transition(family, q, k, v, g, beta, initial_state, scale, chunk_size)
    S0 = S if initial_state is None else S - _apply_T(T, initial_state.float(), f.form)
    return o, S, Summary(T.float(), S0, f.form)


def _apply_T(T: torch.Tensor | LowRankT, X: torch.Tensor, form: str) -> torch.Tensor:
    if isinstance(T, LowRankT):
        return T.apply(X)
    if form == "scalar":
        return T[..., None, None] * X
    if form == "vector":
        return T[..., None] * X
    return torch.matmul(T, X)


def compose(summary: Summary, S_in: torch.Tensor | None) -> torch.Tensor:
    """S_out = T . S_in + S (fp32). S_in None means the zero state."""
    if S_in is None:
        return summary.S.float().clone()
    return _apply_T(summary.T.float(), S_in.float(), summary.form).add_(summary.S.float())


def compose_chain(summaries, S_in: torch.Tensor | None = None, return_all: bool = False):
    """Run S through segments 1..n in order: S_i = T_i S_{i-1} + S_i(0). Returns the final state
    (and, with ``return_all``, the list [S_in, S_1, ..., S_n] of every boundary state)."""
    states = [S_in]
    S = S_in
    for s in summaries:
        S = compose(s, S)
        states.append(S)
    if S is None:
        raise ValueError("compose_chain needs at least one summary or an input state")
    return (S, states) if return_all else S


def merge(first: Summary, second: Summary) -> Summary:
    """Summary of the concatenation first . second: (T2 T1, T2 S1 + S2)."""
    if first.form != second.form:
        raise ValueError("cannot merge summaries of different forms")
    T1, T2 = _formed(first.T).float(), _formed(second.T).float()
    T = torch.matmul(T2, T1) if first.form == "matrix" else T2 * T1
    return Summary(T, compose(second, first.S), first.form)


def _formed(T: torch.Tensor | LowRankT) -> torch.Tensor:
    """A dense T as it is; a LowRankT formed into its [B, H, K, K] matrix."""
    return T.dense() if isinstance(T, LowRankT) else T


def naive_add(summary: Summary, S_in: torch.Tensor | None) -> torch.Tensor:
    """The ablation: S_in + S (drops T)."""
    return summary.S.float().clone() if S_in is None else S_in.float() + summary.S.float()


def rerotate(summary_or_state, R: torch.Tensor):
    """Re-rotate a segment cached at offset 0 for reuse at offset D, with R = R(D) [K, K]
    (broadcastable, [K, K] or batched; R acts on the key dimension).

    state S [.., K, V]  -> R S
    Summary             -> (R T R^T, R S) for the matrix form; scalar T is unchanged; a vector
                           (per-channel) T is unchanged too, which is exact when the gate is
                           tied within every rotation pair (the only case in which a rotated-key
                           recurrence with a per-channel decay composes at another offset).
    """
    Rf = R.float()
    if isinstance(summary_or_state, Summary):
        s = summary_or_state
        S = torch.matmul(Rf, s.S.float())
        if s.form == "matrix":
            T = torch.matmul(torch.matmul(Rf, _formed(s.T).float()), Rf.transpose(-1, -2))
        else:
            T = s.T
        return Summary(T, S, s.form)
    return torch.matmul(Rf, summary_or_state.float())


__all__ = [
    "Summary",
    "summary_form",
    "segment_summary",
    "prefill_with_summary",
    "identity_transition",
    "compose",
    "compose_chain",
    "merge",
    "naive_add",
    "rerotate",
]
