"""Rotary position embedding, full or partial (the first `rotary_dim` channels of a head)."""
import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, partial_factor: float = 1.0, device="cpu"):
        # An explicit device: models are built under torch.device("meta") and this is no weight.
        self.rotary_dim = int(head_dim * partial_factor)
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=device) / self.rotary_dim)
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int) -> cos, sin [T, rotary_dim]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, head_dim]; rotates the first rotary_dim channels (rotate-half layout)."""
        rd = self.rotary_dim
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated at positions p -> the same keys at p + delta, since R(p + d) = R(d) R(p)."""
        if delta == 0:
            return keys
        cos, sin = self.cos_sin(torch.tensor([delta], device=keys.device), keys.dtype)
        return self.apply(keys, cos, sin)
