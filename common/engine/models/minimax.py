"""MiniMax-Text-01 / MiniMax-M1 (minimax): lightning attention + softmax attention, MoE everywhere.

Lightning attention is linear attention with a fixed decay per head (the RetNet family of
kernels.linear_attn): with q, k, v = silu(qkv_proj(x)) split per head,

    S_t = exp(-s_h) S_{t-1} + k_t v_t^T        o_t = S_t^T q_t          (no 1/sqrt(d) scale)
    out = out_proj(sigmoid(output_gate(x)) * RMSNorm(o))                  (one norm over all heads)

s_h = (1 / 2^(8/H))^(h+1) * (1 - layer/(L-1+1e-5) + 1e-5): fixed by the config, never learned, so
T of a segment is the scalar exp(-s_h n) per head and composition is exact. The layer has no short
conv and no rotation, so nothing at a seam needs recomputing for the linear layers' sake.
transformers computes the same recurrence block-wise (its block_size); the state is what it caches.

The decay is handed to the kernels per token ([B, T, H], every token the same) rather than per head:
the batched seam path pads seams and zeroes the gate of the padding, which a [H] gate cannot express.

Decoder layer (note: the residual is the *normed* input, scaled by the config's alpha/beta):

    h = input_layernorm(x);  h = alpha_attn * h + beta_attn * mixer(h)
    h = post_attention_layernorm(h);  out = alpha_mlp * h + beta_mlp * moe(h)

Softmax attention: GQA with full-head RoPE. MoE: softmax router over all experts, top-k renormalised,
SwiGLU experts named block_sparse_moe.experts.{e}.w1/w2/w3 (gate / down / up), router
block_sparse_moe.gate.weight.
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.layers.mlp import activation
from common.engine.layers.norm import RMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import ForwardContext, HybridLM
from common.engine.models.decoder import PreNormLayer, default_rotary, route_to_experts
from common.engine.models.kimi_linear import KimiExpert
from common.engine.models.nemotron_h import Attention
from common.engine.state import LinearLayerState
from kernels.linear_attn import linear_attention, recurrent_step


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates s_h > 0 of one lightning layer (fp32, as transformers computes them)."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(num_heads, dtype=torch.float32, device="cpu") + 1
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base**exponent * factor


class LightningAttention(nn.Module):
    family = "retnet"
    scale = 1.0
    conv_kernel = 1  # no short conv: a segment's cached span starts right after its seam

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dim = self.n_heads * self.head_dim
        self.qkv_proj = nn.Linear(self.hidden, 3 * dim, bias=False)
        self.output_gate = nn.Linear(self.hidden, dim, bias=False)
        self.norm = RMSNorm(dim, 1e-6)  # transformers: MiniMaxRMSNorm's default eps, not rms_norm_eps
        self.out_proj = nn.Linear(dim, self.hidden, bias=False)
        self.act = activation(cfg.hidden_act)
        # log-decay per head, a constant of the architecture (not a weight: built on the CPU explicitly
        # because models are constructed under torch.device("meta"))
        self.log_decay = -lightning_slopes(self.n_heads, layer_idx, cfg.num_hidden_layers)

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """No channel enters a short conv: an empty [B, T, 0]."""
        return x.new_zeros(*x.shape[:2], 0)

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None = None):
        """(q, k, v [B,T,H,D], g [B,T,H] fp32 = the fixed log-decay, beta None, aux = x, tail None);
        `output` needs x itself for the output gate."""
        B, T, _ = x.shape
        qkv = self.act(self.qkv_proj(x)).view(B, T, self.n_heads, 3 * self.head_dim)
        q, k, v = torch.split(qkv, self.head_dim, dim=-1)
        g = self.log_decay.to(x.device).view(1, 1, -1).expand(B, T, -1)
        return q, k, v, g, None, x, None

    def output(self, o: torch.Tensor, x: torch.Tensor, dtype) -> torch.Tensor:
        B, T = o.shape[:2]
        o = self.norm(o.to(dtype).reshape(B, T, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)

    def forward(self, x, state: LinearLayerState | None, ctx: ForwardContext):
        q, k, v, g, _, aux, _ = self.features(x)
        S0 = None if state is None else state.recurrent
        if x.shape[1] == 1 and S0 is not None:
            o, S = recurrent_step(self.family, q, k, v, g=g, state=S0, scale=self.scale)
        else:
            o, S = linear_attention(self.family, q, k, v, g=g, initial_state=S0, scale=self.scale)
        return self.output(o, aux, x.dtype), LinearLayerState(None, S)


class MiniMaxSparseMoe(nn.Module):
    """Softmax over all experts, top-k, renormalised; SwiGLU experts (w1 gate, w3 up, w2 down)."""

    def __init__(self, cfg):
        super().__init__()
        E = cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, E, bias=False)
        self.experts = nn.ModuleList(KimiExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
                                     for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return route_to_experts(h, w, idx, lambda e, t: self.experts[e](t)).view(shape)


def _rotary(cfg, head_dim: int) -> RotaryEmbedding:
    # transformers' MiniMax rotates the whole head (its default rope ignores any partial factor)
    return default_rotary(cfg, head_dim, "minimax")


class MiniMaxLayer(PreNormLayer):
    """The mixer as in PreNormLayer (self_attn); the residuals are MiniMax's alpha/beta mixes."""

    def __init__(self, cfg, idx: int):
        super().__init__()
        D = cfg.hidden_size
        self.kind = "linear" if cfg.layer_types[idx] == "linear_attention" else "attention"
        if self.kind == "linear":
            self.self_attn = LightningAttention(cfg, idx)
            self.alpha, self.beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
        else:
            head_dim = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
            self.self_attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       rotary=_rotary(cfg, head_dim))
            self.alpha, self.beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor
        self.block_sparse_moe = MiniMaxSparseMoe(cfg)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, state, ctx):
        h = self.input_layernorm(x)
        a, new_state = ctx.mix(self.mixer, h, state)
        h = self.post_attention_layernorm(h * self.alpha + a * self.beta)
        return h * self.mlp_alpha + self.block_sparse_moe(h) * self.mlp_beta, new_state


class MiniMaxLM(HybridLM):
    arch = "minimax"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError("minimax: sliding-window attention layers are not supported")
        self.build(cfg, (MiniMaxLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
