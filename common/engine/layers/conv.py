"""Short causal depthwise convolution with an explicit tail state (GDN, KDA, Mamba2 mixers)."""
import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tail: torch.Tensor | None,
                act: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, T]; weight [C, k]; tail [B, C, k-1] (the previous inputs, zeros at the start).

    Returns (y [B, C, T], new tail [B, C, k-1]). The tail is what a later chunk — or the next
    segment of a composed prompt — needs to continue exactly.
    """
    B, C, T = x.shape
    k = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, C, k - 1)
    xx = torch.cat([tail.to(x.dtype), x], dim=-1)
    y = F.conv1d(xx, weight.unsqueeze(1).to(x.dtype), bias, groups=C)
    if act == "silu":
        y = F.silu(y)
    elif act is not None:
        raise ValueError(f"unsupported conv activation {act!r}")
    return y, xx[:, :, -(k - 1):].clone() if k > 1 else x.new_zeros(B, C, 0)
