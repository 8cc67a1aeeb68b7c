"""Per-token reference recurrences for every linear-attention family (fp32, explicit loop).

One contract for all families (shapes, B batch, T tokens, H heads, K key dim, V value dim):

    q, k          [B, T, H, K]
    v             [B, T, H, V]
    g             log-decay <= 0, optional: [H] (fixed per head), [B, T, H] (scalar per token)
                  or [B, T, H, K] (per key channel)
    beta          [B, T, H], optional (delta families)
    initial_state [B, H, K, V], optional (zeros when None)

    S_t = (I - beta_t k_t k_t^T)^delta . diag(exp g_t) . S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t                                   -> o [B, T, H, V], S_T [B, H, K, V]

with delta = 1, b = beta for the delta families and delta = 0, b = 1 otherwise. Mamba2's
[P, N] state is the transpose of this layout (k = B, v = dt*x, q = C, g = dt*A).

These loops are slow on purpose: they are the ground truth the chunked and Triton paths are
tested against, so they follow the formula literally.
"""
from __future__ import annotations

import torch

FAMILIES = ("retnet", "mamba2", "gla", "deltanet", "gated_deltanet", "kda", "mamba")
DELTA_FAMILIES = ("deltanet", "gated_deltanet", "kda")


def expand_gate(g: torch.Tensor | None, B: int, T: int, H: int, K: int) -> torch.Tensor | None:
    """Broadcast any accepted gate shape to [B, T, H, K] (fp32)."""
    if g is None:
        return None
    g = g.float()
    if g.dim() == 1:  # [H]
        return g.view(1, 1, H, 1).expand(B, T, H, K)
    if g.dim() == 3:  # [B, T, H]
        return g.unsqueeze(-1).expand(B, T, H, K)
    if g.dim() == 4:
        return g
    raise ValueError(f"gate must be [H], [B,T,H] or [B,T,H,K], got {tuple(g.shape)}")


def naive_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    delta: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v = q.float(), k.float(), v.float()
    G = expand_gate(g, B, T, H, K)
    b = beta.float() if beta is not None else None
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=k.device)
    if initial_state is not None:
        S = S + initial_state.float()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=k.device)
    for t in range(T):
        if G is not None:
            S = S * G[:, t].exp().unsqueeze(-1)
        kt, vt = k[:, t], v[:, t]  # [B,H,K], [B,H,V]
        if delta:
            bt = b[:, t].unsqueeze(-1)  # [B,H,1]
            kv_mem = torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + torch.einsum("bhk,bhv->bhkv", kt, (vt - kv_mem) * bt)
        else:
            bt = b[:, t].unsqueeze(-1) if b is not None else 1.0
            S = S + torch.einsum("bhk,bhv->bhkv", kt, vt * bt)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def naive_retnet(q, k, v, g, initial_state=None, scale=None):
    """RetNet / Lightning attention: g [H], a fixed log-decay per head."""
    return naive_recurrent(q, k, v, g=g, initial_state=initial_state, scale=scale)


def naive_mamba2(q, k, v, g, initial_state=None, scale=1.0):
    """Mamba2 (SSD): q = C, k = B, v = dt*x, g = dt*A [B,T,H] (scalar per token)."""
    return naive_recurrent(q, k, v, g=g, initial_state=initial_state, scale=scale)


def naive_gla(q, k, v, g, initial_state=None, scale=None):
    """GLA: g [B,T,H,K], a per-channel log-decay."""
    return naive_recurrent(q, k, v, g=g, initial_state=initial_state, scale=scale)


def naive_deltanet(q, k, v, beta, initial_state=None, scale=None):
    """DeltaNet: beta [B,T,H], no decay."""
    return naive_recurrent(q, k, v, beta=beta, initial_state=initial_state, scale=scale, delta=True)


def naive_gated_deltanet(q, k, v, g, beta, initial_state=None, scale=None):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): g [B,T,H] scalar per token, beta [B,T,H]."""
    return naive_recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=True)


def naive_kda(q, k, v, g, beta, initial_state=None, scale=None):
    """KDA (Kimi-Linear): g [B,T,H,K] per channel, beta [B,T,H]."""
    return naive_recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=True)
