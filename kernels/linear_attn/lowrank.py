"""Low-rank (WY) form of a short segment's transition for the scalar-gated delta families.

For deltanet and gated_deltanet, each token's transition is A_t = g_t (I - b_t k_t k_t^T) with a
scalar gate g_t per head, so a segment of L tokens has

    T = A_L ... A_1 = decay . (I - W^T Kf)      decay = prod g_t,  W, Kf [L, K]

(the scalars commute out; the product of L rank-one updates of I is I minus a rank <= L matrix,
the WY representation). Kf holds the keys; W follows from the recursion, latest token first,

    w_t = b_t (k_t - sum_{s > t} w_s (k_s . k_t)).

When L < K/2 the factors (2 L K numbers) are smaller than T (K^2), and T S is applied without
forming T: T S = decay (S - W^T (Kf S)), O(L K V) instead of O(K^2 V). ``lowrank_dense`` forms T
from the factors: the plain reference the tests compare both against. kda's per-channel gates do
not commute out, so it keeps the dense form.
"""
from __future__ import annotations

import torch

LOWRANK_FAMILIES = ("deltanet", "gated_deltanet")


def wy_factors(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None = None):
    """(decay [B, H], W [B, H, L, K], Kf [B, H, L, K]) of the segment given by k [B, L, H, K]
    (normalised as the model uses them), beta [B, L, H] and g [B, L, H] (log gates; None for
    deltanet). fp32 out (fp64 in stays fp64)."""
    dt = torch.float64 if k.dtype == torch.float64 else torch.float32
    Kf = k.to(dt).transpose(1, 2).contiguous()  # [B, H, L, K]
    b = beta.to(dt).transpose(1, 2)  # [B, H, L]
    L = Kf.shape[2]
    W = torch.zeros_like(Kf)
    gram = Kf @ Kf.transpose(-1, -2)  # [B, H, L, L]: k_s . k_t
    for t in range(L - 1, -1, -1):
        # w_t = b_t (k_t - sum_{s > t} w_s (k_s . k_t))
        later = (W[:, :, t + 1 :] * gram[:, :, t + 1 :, t, None]).sum(2)
        W[:, :, t] = b[:, :, t, None] * (Kf[:, :, t] - later)
    decay = torch.ones(Kf.shape[:2], dtype=dt, device=k.device) if g is None else g.to(dt).sum(1).exp()
    return decay, W, Kf


def apply_lowrank(decay: torch.Tensor, W: torch.Tensor, Kf: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """T S for T = decay (I - W^T Kf) without forming T: decay (S - W^T (Kf S)). S [B, H, K, V]."""
    return decay[..., None, None] * (S - W.transpose(-1, -2) @ (Kf @ S))


def lowrank_dense(decay: torch.Tensor, W: torch.Tensor, Kf: torch.Tensor) -> torch.Tensor:
    """T [B, H, K, K] formed from its factors (the reference of apply_lowrank)."""
    eye = torch.eye(Kf.shape[-1], dtype=Kf.dtype, device=Kf.device)
    return decay[..., None, None] * (eye - W.transpose(-1, -2) @ Kf)


def lowrank_pays(L: int, K: int) -> bool:
    """True when the factors (2 L K) are smaller than the dense K x K T."""
    return 2 * L < K
