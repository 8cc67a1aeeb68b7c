"""Falcon-H1 (TII): every layer runs Mamba2 and attention IN PARALLEL on the same normed input.

    h = input_layernorm(x)
    x = x + ssm_out * mamba(ssm_in * h) + attn_out * attention(attn_in * h)
    x = x + feed_forward(pre_ff_layernorm(x))

with muP multipliers everywhere (embedding, key, the five parts of the Mamba in_proj output
[z | x | B | C | dt], the MLP gate and down projections, the LM head).

One Falcon-H1 layer is two of our layers, so that each holds one kind of state and the PIC
machinery (entries, seams, layer-major plans) treats it like any other hybrid:
    layer 2i   (kind "attention"): h = input_layernorm(x), kept in ctx.cache for layer 2i+1;
                                   x + attn_out * attention(attn_in * h)
    layer 2i+1 (kind "linear"):    x + ssm_out * mamba(h) (ssm_in inside the mixer), then the MLP.
The sum is the same (only its float association differs), and each part composes exactly: the
attention keys are RoPE-rotated (rerotated on reuse), the Mamba2 state composes through T.

Checkpoint names: model.embed_tokens, model.layers.{i}.{self_attn,mamba,feed_forward,
input_layernorm,pre_ff_layernorm}, model.final_layernorm, lm_head; our layers.{j}.* is
model.layers.{j // 2}.*.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.layers.mamba2 import Mamba2Mixer
from common.engine.layers.mlp import activation
from common.engine.layers.norm import GatedRMSNorm, RMSNorm
from common.engine.models.base import HybridLM
from common.engine.models.decoder import default_rotary
from common.engine.models.nemotron_h import Attention

_NORMED_INPUT = "falcon_h1.normed_input"  # ctx.cache key: layer 2i's normed input for layer 2i+1


class MupInProj(nn.Linear):
    """Mamba2 in_proj with Falcon-H1's multipliers: (in_mult * x) W^T, each of the five output
    parts [z | x | B | C | dt] scaled by its own multiplier."""

    def __init__(self, hidden: int, sizes: list[int], in_mult: float, part_mults: list[float], bias: bool):
        super().__init__(hidden, sum(sizes), bias=bias)
        self.sizes, self.in_mult, self.part_mults = sizes, float(in_mult), [float(m) for m in part_mults]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x * self.in_mult)
        mup = torch.cat([torch.full((n,), m, dtype=y.dtype, device=y.device)
                         for n, m in zip(self.sizes, self.part_mults)])
        return y * mup


class FalconH1Mamba(Mamba2Mixer):
    """Mamba2 with muP in_proj, an optional gated norm (else y * silu(z)) and its own out bias."""

    def __init__(self, cfg):
        D = cfg.hidden_size
        inner = cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * D)
        super().__init__(D, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups,
                         cfg.mamba_d_conv, cfg.rms_norm_eps, proj_bias=cfg.mamba_proj_bias,
                         conv_bias=cfg.mamba_conv_bias, activation=cfg.hidden_act, dt_limit=cfg.time_step_limit)
        GN = cfg.mamba_n_groups * cfg.mamba_d_state
        self.in_proj = MupInProj(D, [inner, inner, GN, GN, cfg.mamba_n_heads], cfg.ssm_in_multiplier,
                                 cfg.ssm_multipliers, cfg.mamba_proj_bias)
        self.out_proj = nn.Linear(inner, D, bias=cfg.projectors_bias)
        self.norm = (GatedRMSNorm(inner, cfg.rms_norm_eps, group_size=inner // cfg.mamba_n_groups,
                                  norm_before_gate=cfg.mamba_norm_before_gate) if cfg.mamba_rms_norm else None)

    def output(self, o: torch.Tensor, aux, dtype) -> torch.Tensor:
        if self.norm is not None:
            return super().output(o, aux, dtype)
        z, xs = aux
        Bsz, T = o.shape[:2]
        y = (o.float() + self.D.float()[:, None] * xs.float()).reshape(Bsz, T, self.intermediate)
        return self.out_proj((y * nn.functional.silu(z.float())).to(dtype))


class KeyScaledAttention(Attention):
    """GQA + RoPE with the keys multiplied by key_multiplier (transformers scales before the
    rotation; rotation is linear, so scaling after it is the same)."""

    def __init__(self, *args, key_multiplier: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_multiplier = float(key_multiplier)

    def qkv(self, x, positions):
        q, k, v = super().qkv(x, positions)
        return q, k * self.key_multiplier, v


class FalconH1MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, I, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(D, I, bias=bias)
        self.up_proj = nn.Linear(D, I, bias=bias)
        self.down_proj = nn.Linear(I, D, bias=bias)
        self.act = activation(cfg.hidden_act)
        self.gate_mult, self.down_mult = (float(m) for m in cfg.mlp_multipliers)

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_mult)) * self.down_mult


class FalconH1AttentionPart(nn.Module):
    """Layer 2i: the input norm and the attention branch of Falcon-H1 layer i."""

    kind = "attention"

    def __init__(self, cfg):
        super().__init__()
        D, n_q = cfg.hidden_size, cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or D // n_q
        rotary = default_rotary(cfg, head_dim, "falcon_h1")
        self.self_attn = KeyScaledAttention(D, n_q, cfg.num_key_value_heads, head_dim, bias=cfg.attention_bias,
                                            rotary=rotary, key_multiplier=cfg.key_multiplier)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.in_mult, self.out_mult = float(cfg.attention_in_multiplier), float(cfg.attention_out_multiplier)

    @property
    def mixer(self):
        return self.self_attn

    def forward(self, x, state, ctx):
        h = self.input_layernorm(x)
        ctx.cache[(_NORMED_INPUT, ctx.layer)] = h
        a, new_state = ctx.mix(self.self_attn, h * self.in_mult, state)
        return x + a * self.out_mult, new_state


class FalconH1MambaPart(nn.Module):
    """Layer 2i+1: the Mamba2 branch of Falcon-H1 layer i (on layer 2i's normed input), then the MLP."""

    kind = "linear"

    def __init__(self, cfg):
        super().__init__()
        self.mamba = FalconH1Mamba(cfg)
        self.feed_forward = FalconH1MLP(cfg)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.out_mult = float(cfg.ssm_out_multiplier)

    @property
    def mixer(self):
        return self.mamba

    def forward(self, x, state, ctx):
        h = ctx.cache.pop((_NORMED_INPUT, ctx.layer - 1))
        m, new_state = ctx.mix(self.mamba, h, state)
        x = x + m * self.out_mult
        return x + self.feed_forward(self.pre_ff_layernorm(x)), new_state


class FalconH1LM(HybridLM):
    arch = "falcon_h1"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        parts = (part for _ in range(cfg.num_hidden_layers) for part in (FalconH1AttentionPart(cfg),
                                                                         FalconH1MambaPart(cfg)))
        self.build(cfg, parts, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), final_norm="final_layernorm")
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.lm_head_multiplier = float(cfg.lm_head_multiplier)

    @property
    def norm(self) -> nn.Module:
        return self.final_layernorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden) * self.lm_head_multiplier

    def checkpoint_name_fn(self, reader):
        name_of = super().checkpoint_name_fn(reader)

        def falcon_name(p: str) -> str | None:
            if p.startswith("layers."):
                _, j, rest = p.split(".", 2)
                p = f"layers.{int(j) // 2}.{rest}"
            return name_of(p)

        return falcon_name
