"""Jamba (AI21): Mamba (v1) layers with a full-attention layer every `attn_layer_period`, each
followed by an MLP or, every `expert_layer_period`, a top-k MoE of the same SwiGLU MLPs.

Layer i is attention if i % attn_layer_period == attn_layer_offset, else Mamba v1
(common.engine.layers.mamba, family "mamba": a diagonal state per inner channel x state index). Attention
is plain GQA without positions (no RoPE: cached attention bodies need no rerotation). Block:
x += mixer(input_layernorm(x)); x += feed_forward(pre_ff_layernorm(x)). Checkpoint names:
model.embed_tokens, model.layers.{i}.{mamba,self_attn,feed_forward,input_layernorm,
pre_ff_layernorm}, feed_forward.router / .experts.{e}.{gate,up,down}_proj, model.final_layernorm,
lm_head (tied when config.tie_word_embeddings).
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.layers.mamba import MambaMixer
from common.engine.layers.mlp import GatedMLP
from common.engine.layers.norm import RMSNorm
from common.engine.models.base import HybridLM
from common.engine.models.decoder import PreNormLayer, route_to_experts
from common.engine.models.nemotron_h import Attention


class JambaMoE(nn.Module):
    """Softmax over the router logits, top-k, the selected weights NOT renormalised (Jamba)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(h).float(), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w.to(h.dtype)
        return route_to_experts(h, top_w, top_idx, lambda e, t: self.experts[e](t)).view(shape)


class JambaLayer(PreNormLayer):
    MIXER = {"linear": "mamba", "attention": "self_attn"}
    FFN, FFN_NORM = "feed_forward", "pre_ff_layernorm"

    def __init__(self, cfg, idx: int):
        super().__init__()
        self.kind = "attention" if cfg.layers_block_type[idx] == "attention" else "linear"
        D = cfg.hidden_size
        if self.kind == "linear":
            self.mamba = MambaMixer(D, cfg.mamba_expand * D, cfg.mamba_d_state, cfg.mamba_dt_rank, cfg.mamba_d_conv,
                                    cfg.rms_norm_eps, proj_bias=cfg.mamba_proj_bias, conv_bias=cfg.mamba_conv_bias,
                                    activation=cfg.hidden_act)
        else:
            n_q = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or D // n_q
            self.self_attn = Attention(D, n_q, cfg.num_key_value_heads, head_dim)
        if cfg.layers_num_experts[idx] > 1:
            self.feed_forward = JambaMoE(D, cfg.intermediate_size, cfg.layers_num_experts[idx],
                                         cfg.num_experts_per_tok, cfg.hidden_act)
        else:
            self.feed_forward = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(D, cfg.rms_norm_eps)


class JambaLM(HybridLM):
    arch = "jamba"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (JambaLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), final_norm="final_layernorm")

    @property
    def norm(self) -> nn.Module:  # HybridLM's forward applies self.norm; the checkpoint says final_layernorm
        return self.final_layernorm
