import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. `zero_centered`: weight stored as w-1 (Qwen3-Next/3.5: x*(1+w))."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        # Llama convention: cast back first, then scale in the weight dtype.
        return self.weight * h.to(dtype)


class GatedRMSNorm(nn.Module):
    """Norm then SiLU gate, per head (the output norm of GDN / KDA / Mamba2 mixers).

    `group_size` splits the last dim in groups normalised separately (Mamba2's n_groups).
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        if not self.norm_before_gate:
            h = h * nn.functional.silu(gate.float())
        shape = h.shape
        if self.group_size is not None:
            h = h.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.view(shape)
        if self.norm_before_gate:
            h = self.weight * h.to(dtype)
            return (h * nn.functional.silu(gate.float())).to(dtype)
        return (self.weight * h.to(dtype)).to(dtype)
