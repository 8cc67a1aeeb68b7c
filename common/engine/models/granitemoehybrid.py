"""Granite 4 (granitemoehybrid): Mamba2 layers with a few full-attention layers, MoE + shared MLP.

Layer i is Mamba2 (common.engine.layers.mamba2) when `config.layer_types[i] == "linear_attention"`, else
GQA attention, with RoPE only when `config.position_embedding_type == "rope"` (Granite-4.0-H ships
NoPE: cached keys then hold at any position as they are). Granite's muP-style scalars:
embeddings * embedding_multiplier, attention scale = attention_multiplier (not head_dim^-0.5),
each residual branch * residual_multiplier, logits / logits_scaling.

    x = x + r * mixer(input_layernorm(x))
    h = post_attention_layernorm(x);  x = x + r * (moe(h) + shared_mlp(h))      (moe absent if 0 experts)

Checkpoint names: model.layers.{i}.{mamba,self_attn}.*, block_sparse_moe.router.layer.weight
[E, D], block_sparse_moe.input_linear.weight [E, 2I, D] (gate | up), output_linear.weight [E, D, I],
shared_mlp.input_linear [2S, D] (gate | up), shared_mlp.output_linear [D, S].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.mlp import activation
from common.engine.layers.norm import RMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import HybridLM
from common.engine.models.decoder import PreNormLayer, default_rotary, mamba2_from_config, route_to_experts
from common.engine.models.nemotron_h import Attention


class GraniteSharedMLP(nn.Module):
    """output_linear(act(gate) * up) with gate | up = input_linear(x)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GraniteRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k of the router logits, softmax over the k chosen (not over all experts)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, act: str):
        super().__init__()
        self.top_k = top_k
        self.router = GraniteRouter(hidden, num_experts)
        # Stacked expert weights, named as the checkpoint's input_linear.weight / output_linear.weight.
        self.input_linear, self.output_linear = nn.Module(), nn.Module()
        self.input_linear.weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.output_linear.weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        top_logits, idx = self.router.layer(h).float().topk(self.top_k, dim=-1)
        w = torch.softmax(top_logits, dim=-1).to(h.dtype)
        return route_to_experts(h, w, idx, self.expert).view(shape)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear.weight[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear.weight[e])


def _rotary(cfg, head_dim: int) -> RotaryEmbedding | None:
    if getattr(cfg, "position_embedding_type", None) != "rope":
        return None  # NoPE
    return default_rotary(cfg, head_dim, "granitemoehybrid")


class GraniteLayer(PreNormLayer):
    """The mixer as in PreNormLayer; the feed-forward is the shared MLP (+ the MoE), both branches
    scaled by residual_multiplier."""

    MIXER = {"linear": "mamba", "attention": "self_attn"}

    def __init__(self, cfg, idx: int):
        super().__init__()
        D = cfg.hidden_size
        self.kind = "linear" if cfg.layer_types[idx] == "linear_attention" else "attention"
        if self.kind == "linear":
            self.mamba = mamba2_from_config(cfg)
        else:
            head_dim = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
            self.self_attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       bias=cfg.attention_bias, rotary=_rotary(cfg, head_dim))
            self.self_attn.scale = float(cfg.attention_multiplier)
        E = cfg.num_local_experts or 0
        self.block_sparse_moe = (
            GraniteMoE(D, E, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.hidden_act) if E > 0 else None
        )
        self.shared_mlp = GraniteSharedMLP(D, cfg.shared_intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, x, state, ctx):
        h, new_state = ctx.mix(self.mixer, self.input_layernorm(x), state)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        y = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(h) + y
        return x + y * self.residual_multiplier, new_state


class GraniteMoeHybridLM(HybridLM):
    arch = "granitemoehybrid"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (GraniteLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.embedding_multiplier = float(cfg.embedding_multiplier)
        self.logits_scaling = float(cfg.logits_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().logits(hidden) / self.logits_scaling
