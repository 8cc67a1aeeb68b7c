"""Bamba (IBM): Mamba2 layers with a few full-attention layers, each followed by a SwiGLU MLP.

Layer i is attention if i is in `config.attn_layer_indices`, else Mamba2 (common.engine.layers.mamba2).
Attention is plain GQA with partial RoPE (the first half of each head, rotate-half layout).
Block: x += mixer(input_layernorm(x)); x += feed_forward(pre_ff_layernorm(x)). Checkpoint names:
model.embed_tokens, model.layers.{i}.{mamba,self_attn,feed_forward,input_layernorm,
pre_ff_layernorm}, model.final_layernorm, lm_head (tied when config.tie_word_embeddings).
"""
from __future__ import annotations

from torch import nn

from common.engine.layers.mlp import GatedMLP
from common.engine.layers.norm import RMSNorm
from common.engine.models.base import HybridLM
from common.engine.models.decoder import PreNormLayer, default_rotary, mamba2_from_config
from common.engine.models.nemotron_h import Attention


class BambaLayer(PreNormLayer):
    MIXER = {"linear": "mamba", "attention": "self_attn"}
    FFN, FFN_NORM = "feed_forward", "pre_ff_layernorm"

    def __init__(self, cfg, idx: int):
        super().__init__()
        self.kind = "attention" if idx in (cfg.attn_layer_indices or []) else "linear"
        D = cfg.hidden_size
        if self.kind == "linear":
            self.mamba = mamba2_from_config(cfg)
        else:
            head_dim = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
            partial = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor", 0.5)
            self.self_attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       bias=cfg.attention_bias, rotary=default_rotary(cfg, head_dim, "bamba", partial))
        self.feed_forward = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act)
        if cfg.mlp_bias:
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(self.feed_forward, name)
                setattr(self.feed_forward, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(D, cfg.rms_norm_eps)


class BambaLM(HybridLM):
    arch = "bamba"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (BambaLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), final_norm="final_layernorm")

    @property
    def norm(self) -> nn.Module:  # HybridLM's forward applies self.norm; the checkpoint says final_layernorm
        return self.final_layernorm
