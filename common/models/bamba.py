"""Bamba (IBM): Mamba2 layers with a few full-attention layers, each followed by a SwiGLU MLP.

Layer i is attention if i is in `config.attn_layer_indices`, else Mamba2 (common.layers.mamba2).
Attention is plain GQA with partial RoPE (the first half of each head, rotate-half layout).
Block: x += mixer(input_layernorm(x)); x += feed_forward(pre_ff_layernorm(x)). Checkpoint names:
model.embed_tokens, model.layers.{i}.{mamba,self_attn,feed_forward,input_layernorm,
pre_ff_layernorm}, model.final_layernorm, lm_head (tied when config.tie_word_embeddings).
"""
from __future__ import annotations

from torch import nn

from common.layers.mamba2 import Mamba2Mixer
from common.layers.mlp import GatedMLP
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding
from common.models.base import HybridLM
from common.models.nemotron_h import Attention


def _rotary(cfg, head_dim: int) -> RotaryEmbedding:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"bamba: unsupported rope_type {rope_type!r}")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return RotaryEmbedding(head_dim, theta, rope.get("partial_rotary_factor", 0.5))


class BambaLayer(nn.Module):
    def __init__(self, cfg, idx: int):
        super().__init__()
        self.kind = "attention" if idx in (cfg.attn_layer_indices or []) else "linear"
        D = cfg.hidden_size
        if self.kind == "linear":
            self.mamba = Mamba2Mixer(
                D, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv,
                cfg.rms_norm_eps, proj_bias=cfg.mamba_proj_bias, conv_bias=cfg.mamba_conv_bias,
                activation=cfg.hidden_act, dt_limit=cfg.time_step_limit,
            )
        else:
            head_dim = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
            self.self_attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       bias=cfg.attention_bias, rotary=_rotary(cfg, head_dim))
        self.feed_forward = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act)
        if cfg.mlp_bias:
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(self.feed_forward, name)
                setattr(self.feed_forward, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(D, cfg.rms_norm_eps)

    @property
    def mixer(self):
        return self.mamba if self.kind == "linear" else self.self_attn

    def forward(self, x, state, ctx):
        h, new_state = ctx.mix(self.mixer, self.input_layernorm(x), state)
        x = x + h
        x = x + self.feed_forward(self.pre_ff_layernorm(x))
        return x, new_state


class BambaLM(HybridLM):
    arch = "bamba"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BambaLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.layer_kinds = [layer.kind for layer in self.layers]
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def norm(self) -> nn.Module:  # HybridLM's forward applies self.norm; the checkpoint says final_layernorm
        return self.final_layernorm
