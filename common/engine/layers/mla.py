"""Multi-head latent attention (DeepSeek-V2 layout), the one MLA both Kimi-Linear and Ring / Ling 2.5
(bailing_hybrid) use; the two differ only in options:

- keys = [kv_b(norm(c))_nope, k_rot shared over heads], values = kv_b(norm(c))_v, where c and k_rot
  come from one down-projection (kv_a_proj_with_mqa) of x; q from q_proj, or through a q LoRA
  (q_a_proj, q_a_layernorm, q_b_proj) when the config has q_lora_rank; scale (nope + rope)^-0.5.
- rotary: None (Kimi: k_rot and q_rot are used raw) or DeepSeek's interleaved-pair RoPE on the rope
  channels (bailing), which equals the rotate-half form on the de-interleaved channels (evens then
  odds), so the rotated channels are stored in that layout and re-rotation turns them as they are.
- output_gate: a sigmoid gate per head, g_proj(x), on the attention output (bailing).
- out_proj: the output projection's checkpoint name ("o_proj" for Kimi, "dense" for bailing).

The layer state (and so a PIC entry) keeps what the model's own KV cache holds: the normed latent c
and the (rotated) k_rot, one shared "head" [B,1,T,kv_lora_rank+rope], and zero-width values (the
values ARE the latent: the first kv_lora_rank key channels, `latent_values`). Attention runs with
the up-projection absorbed: q_lat = W_uk^T q_nope per head, scores = [q_lat; q_rot] . [c; k_rot],
o = W_uv (softmax . c) — equal to the up-projected form (keys kv_b(c), per-head values) to float
round-off, at (kv_lora_rank + rope) / (heads * (nope + rope + v_dim)) of its cache size.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.layers.attention import append_kv, attend, causal_attention
from common.engine.layers.norm import RMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.state import AttentionLayerState


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved-pair RoPE == rotate-half on this."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """MLA with its KV cache in latent form (see the module docstring for the options)."""

    def __init__(self, cfg, rotary: RotaryEmbedding | None = None, output_gate: bool = False,
                 out_proj: str = "o_proj"):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden, self.n_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers: default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)  # transformers: default eps
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.out_proj_name = out_proj  # the parameter's name is the checkpoint's
        setattr(self, out_proj, nn.Linear(self.n_heads * self.v_dim, self.hidden, bias=bias))
        self.g_proj = nn.Linear(self.hidden, self.n_heads, bias=False) if output_gate else None
        self.rotary = rotary
        self.scale = self.qk_dim**-0.5

    @property
    def latent_values(self) -> int:
        """The values are the first kv_lora_rank channels of the cached keys (stored once)."""
        return self.kv_lora_rank

    def _up_weights(self):
        """kv_b_proj split per head: W_uk [H, nope, r], W_uv [H, v_dim, r]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if self.rotary is None:
            return x
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return self.rotary.apply(deinterleave(x), cos, sin)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor | None):
        """Absorbed query q [B,H,T,r+rope]; the latent key [B,1,T,r+rope] = [norm(c); k_rot] (rope part
        rotated at `positions` when the layer has a rotary); zero-width values [B,1,T,0] (the values
        are the keys' first r channels)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = torch.split(q.view(B, T, self.n_heads, self.qk_dim).transpose(1, 2),
                                    [self.nope, self.rope], dim=-1)
        w_uk, _ = self._up_weights()
        q_lat = torch.matmul(q_nope, w_uk)  # [B,H,T,r]: q_nope . (W_uk c) == (W_uk^T q_nope) . c
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], dim=-1)
        k_rot = self._rotate(k_rot.unsqueeze(1), positions)
        k = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_rot], dim=-1)
        return torch.cat([q_lat, self._rotate(q_rot, positions)], dim=-1), k, k.new_zeros(B, 1, T, 0)

    def expand_values(self, keys: torch.Tensor) -> torch.Tensor:
        return keys[..., : self.kv_lora_rank]

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys stored at positions p -> at p + delta: only the rope channels (the last `rope`) turn;
        without a rotary cached keys hold at any position as they are."""
        if self.rotary is None or delta == 0:
            return keys
        latent, k_rot = torch.split(keys, [self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([latent, self.rotary.rerotate(k_rot, delta)], dim=-1)

    def forward(self, x, state: AttentionLayerState | None, ctx):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx.positions)
        if ctx.plan is not None:
            o, new_state = attend(q, k, v, state, self.scale, ctx)  # the plan reads latent_values
        else:
            new_state = append_kv(state, k, v)
            o = causal_attention(q, new_state.keys, self.expand_values(new_state.keys), self.scale)
        _, w_uv = self._up_weights()
        o = torch.matmul(o.transpose(1, 2), w_uv.transpose(1, 2)).transpose(1, 2)  # [B,T,H,r] -> [B,T,H,v_dim]
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x).float()).to(x.dtype).unsqueeze(-1)
        return getattr(self, self.out_proj_name)(o.reshape(B, T, -1)), new_state
