"""Rotary position embedding as explicit rotations, for re-rotating cached linear-layer states.

A linear layer whose keys are rotated by absolute position (k_p = R(p) k) and whose segment was
cached at offset 0 sees, when reused at offset D, keys R(D) R(t) k: its zero-start state becomes
R(D) S and its (matrix) transition R(D) T R(D)^T (R is orthogonal). Conventions follow
transformers: "rotate_half" pairs (i, i + r/2) by default, GPT-J style pairs (2i, 2i+1) with
``interleaved=True``; partial rotary rotates the first ``rotary_dim`` channels only.
Angles are computed in float64 (positions times frequencies lose precision in fp32).
"""
from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """[rotary_dim // 2] float64 inverse frequencies theta^(-2i / rotary_dim)."""
    if rotary_dim % 2:
        raise ValueError("rotary_dim must be even")
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
    return 1.0 / (theta ** (i / rotary_dim))


def _pairs(head_dim: int, rotary_dim: int, interleaved: bool, device=None):
    h = rotary_dim // 2
    ar = torch.arange(h, device=device)
    if interleaved:
        return 2 * ar, 2 * ar + 1
    return ar, ar + h


def rope_rotation(
    delta,
    head_dim: int,
    rotary_dim: int | None = None,
    theta: float = 10000.0,
    interleaved: bool = False,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """R(delta) [K, K] (or [*delta.shape, K, K] for a tensor of offsets): x -> R x rotates x by delta.

    Block-diagonal: a 2x2 rotation per frequency on the rotary channels, identity on the rest.
    """
    rd = head_dim if rotary_dim is None else rotary_dim
    d = torch.as_tensor(delta, dtype=torch.float64, device=device)
    ang = d.unsqueeze(-1) * rope_inv_freq(rd, theta, device=d.device)  # [..., rd/2]
    c, s = torch.cos(ang), torch.sin(ang)
    R = torch.eye(head_dim, dtype=torch.float64, device=d.device).expand(*d.shape, head_dim, head_dim).clone()
    a, b = _pairs(head_dim, rd, interleaved, d.device)
    R[..., a, a] = c
    R[..., a, b] = -s
    R[..., b, a] = s
    R[..., b, b] = c
    return R.to(dtype)


def apply_rope(
    x: torch.Tensor,
    positions,
    rotary_dim: int | None = None,
    theta: float = 10000.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate x [B, T, H, K] by its absolute positions ([T] or [B, T]); returns x's dtype."""
    B, T, H, K = x.shape
    rd = K if rotary_dim is None else rotary_dim
    pos = torch.as_tensor(positions, dtype=torch.float64, device=x.device)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0).expand(B, T)
    ang = pos.unsqueeze(-1) * rope_inv_freq(rd, theta, device=x.device)  # [B, T, rd/2]
    c = torch.cos(ang).unsqueeze(2)
    s = torch.sin(ang).unsqueeze(2)  # [B, T, 1, rd/2]
    a, b = _pairs(K, rd, interleaved, x.device)
    xf = x.double()
    xa, xb = xf[..., a], xf[..., b]
    out = xf.clone()
    out[..., a] = xa * c - xb * s
    out[..., b] = xb * c + xa * s
    return out.to(x.dtype)


__all__ = ["rope_inv_freq", "rope_rotation", "apply_rope"]
