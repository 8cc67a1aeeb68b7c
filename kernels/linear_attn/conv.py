"""Short causal depthwise convolution (the kernel-c conv before GDN / KDA / Mamba2 mixers).

Layout: x [B, T, D] (token-major), weight [D, c], conv tail [B, c-1, D] = the last c-1 *inputs*
(before the conv) that the next token window needs. Under position-independent caching the first
c-1 tokens of a segment must be recomputed at reuse with the previous segment's tail; everything
after them depends only on the segment's own tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_tail(x: torch.Tensor, kernel_size: int, prev_tail: torch.Tensor | None = None) -> torch.Tensor:
    """The last ``kernel_size - 1`` inputs of ``x`` [B, T, D] as [B, c-1, D].

    When the segment is shorter than c-1 tokens the tail reaches into what came before it:
    ``prev_tail`` (zeros when None, i.e. the segment started the prompt).
    """
    B, T, D = x.shape
    w = kernel_size - 1
    if w <= 0:
        return x.new_zeros(B, 0, D)
    if T >= w:
        return x[:, T - w :].clone()
    prev = prev_tail if prev_tail is not None else x.new_zeros(B, w, D)
    return torch.cat([prev[:, prev.shape[1] - (w - T) :].to(x.dtype), x], dim=1)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over x [B, T, D] with weight [D, c] -> (y [B, T, D], new tail [B, c-1, D]).

    ``conv_state`` [B, >= c-1, D]: the inputs just before x (its last c-1 rows are used);
    zeros when None (x starts the sequence). y_t = sum_i weight[:, i] * x_{t - (c-1) + i}.
    """
    B, T, D = x.shape
    c = weight.shape[-1]
    w = c - 1
    if conv_state is None:
        prev = x.new_zeros(B, w, D)
    else:
        prev = conv_state[:, conv_state.shape[1] - w :].to(x.dtype)
    xx = torch.cat([prev, x], dim=1)  # [B, w + T, D]
    y = F.conv1d(xx.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), bias, groups=D).transpose(1, 2)
    if activation == "silu":
        y = F.silu(y)
    elif activation not in (None, "identity"):
        raise ValueError(f"unknown activation {activation!r}")
    return y, xx[:, xx.shape[1] - w :].clone()


__all__ = ["causal_conv1d", "conv_tail"]
