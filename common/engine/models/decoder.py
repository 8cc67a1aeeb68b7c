"""The decoder-layer pieces several hybrid models share (each model file keeps only what is its own).

- PreNormLayer: x = x + mixer(input_layernorm(x)); x = x + ffn(ffn_norm(x)), with the parts named
  as each model's checkpoint names them;
- default_rotary: RoPE from a config's rope_parameters (only rope_type "default" is served);
- mamba2_from_config: a Mamba2 mixer from the Bamba / Granite-4 config fields;
- route_to_experts: the top-k MoE dispatch loop (each token through its chosen experts);
- ChunkedLinearMixer: the forward pass of a linear-attention mixer with a short conv (GDN, KDA).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from common.engine.layers.mamba2 import Mamba2Mixer
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.state import LinearLayerState
from kernels.linear_attn import linear_attention, recurrent_step


class PreNormLayer(nn.Module):
    """x = x + mixer(input_layernorm(x)); x = x + ffn(ffn_norm(x)); the mixer's new state passes on.

    Subclasses build the parts under their checkpoint's names and say which is which:
    MIXER maps the layer's kind ("linear" / "attention") to the mixer's attribute, FFN and
    FFN_NORM name the MLP (or MoE) and the norm before it. `self.kind` must be set."""

    MIXER = {"linear": "self_attn", "attention": "self_attn"}
    FFN, FFN_NORM = "mlp", "post_attention_layernorm"

    @property
    def mixer(self):
        return getattr(self, self.MIXER[self.kind])

    def forward(self, x, state, ctx):
        h, new_state = ctx.mix(self.mixer, self.input_layernorm(x), state)
        x = x + h
        x = x + getattr(self, self.FFN)(getattr(self, self.FFN_NORM)(x))
        return x, new_state


def default_rotary(cfg, head_dim: int, arch: str, partial: float = 1.0) -> RotaryEmbedding:
    """RoPE over `partial` of each head with the config's theta (rope_parameters first, then
    rope_theta, else 10000); any rope_type but "default" is refused."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{arch}: unsupported rope_type {rope.get('rope_type')!r}")
    return RotaryEmbedding(head_dim, rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)), partial)


def mamba2_from_config(cfg) -> Mamba2Mixer:
    """Mamba2 from the config fields Bamba and Granite-4 share (mamba_n_heads, mamba_d_head, ...)."""
    return Mamba2Mixer(
        cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups,
        cfg.mamba_d_conv, cfg.rms_norm_eps, proj_bias=cfg.mamba_proj_bias, conv_bias=cfg.mamba_conv_bias,
        activation=cfg.hidden_act, dt_limit=cfg.time_step_limit,
    )


def route_to_experts(h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                     expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k w[n, k] * expert(idx[n, k], h[n]) for tokens h [N, D], weights w and expert ids idx
    [N, k]; each expert runs once on the tokens that chose it. Every product is cast to h's dtype
    before it is added (a no-op where w already has it)."""
    out = torch.zeros_like(h)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        out.index_add_(0, tok, (expert(e, h[tok]) * w[tok, slot, None]).to(h.dtype))
    return out


class ChunkedLinearMixer(nn.Module):
    """A linear-attention mixer of kernels.linear_attn's `family` (set by the subclass, with `scale`):
    features(x, conv tail) -> (q, k, v, g, beta, aux, new conv tail); the recurrence (one
    recurrent step for a single decoded token, else chunked); output(o, aux, dtype)."""

    def forward(self, x, state: LinearLayerState | None, ctx):
        q, k, v, g, beta, aux, tail = self.features(x, None if state is None else state.conv)
        S0 = None if state is None else state.recurrent
        if x.shape[1] == 1 and S0 is not None:
            o, S = recurrent_step(self.family, q, k, v, g=g, beta=beta, state=S0, scale=self.scale)
        else:
            o, S = linear_attention(self.family, q, k, v, g=g, beta=beta, initial_state=S0, scale=self.scale)
        return self.output(o, aux, x.dtype), LinearLayerState(tail, S)
