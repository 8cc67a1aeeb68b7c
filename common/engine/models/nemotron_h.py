"""NemotronH (Nemotron-H, Nemotron-Nano-2, Nemotron-3-Nano): a stack of single-mixer blocks.

Block i is `x + mixer(norm(x))` with the mixer given by `config.layers_block_type[i]`:
"linear_attention" (Mamba2, common.engine.layers.mamba2), "full_attention" (plain GQA: no RoPE, no
gate, no q/k norm), "mlp" (up -> relu2 -> down) or "moe" (sigmoid-routed, grouped top-k experts
of the same non-gated MLP plus a shared expert). Norms multiply their weight in fp32. Checkpoint
names: backbone.embeddings, backbone.layers.{i}.norm / .mixer.*, backbone.norm_f, lm_head
(never tied: transformers' NemotronHForCausalLM ties nothing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.attention import attend
from common.engine.layers.mamba2 import Mamba2Mixer
from common.engine.layers.mlp import activation
from common.engine.layers.norm import RMSNorm
from common.engine.models.base import ForwardContext, HybridLM


class FP32RMSNorm(RMSNorm):
    """RMSNorm whose weight multiply stays in fp32 (cast to the input dtype only at the end)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention, optionally with (partial) rotary positions; no gate, no q/k norm."""

    def __init__(self, hidden: int, n_q: int, n_kv: int, head_dim: int, bias: bool = False, rotary=None):
        super().__init__()
        self.n_q, self.n_kv, self.head_dim = n_q, n_kv, head_dim
        self.q_proj = nn.Linear(hidden, n_q * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_q * head_dim, hidden, bias=bias)
        self.rotary = rotary
        self.scale = head_dim**-0.5

    def qkv(self, x, positions):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_q, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, q.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v

    def forward(self, x, state, ctx: ForwardContext):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx.positions)
        o, new_state = attend(q, k, v, state, self.scale, ctx)
        return self.o_proj(o.reshape(B, T, -1)), new_state

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        return keys if self.rotary is None else self.rotary.rerotate(keys, delta)


class UpDownMLP(nn.Module):
    """down(act(up(x))) — NemotronH's non-gated MLP (relu2)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Sigmoid router with a score-correction bias and group-limited top-k (DeepSeek-V3 style),
    non-gated relu2 experts (optionally in a latent dim) and a shared expert."""

    def __init__(self, cfg):
        super().__init__()
        D, E = cfg.hidden_size, cfg.n_routed_experts
        self.n_experts, self.top_k = E, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        latent = cfg.moe_latent_size
        act, bias = cfg.mlp_hidden_act, cfg.mlp_bias
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, D))
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(E))
        self.experts = nn.ModuleList(UpDownMLP(latent or D, cfg.moe_intermediate_size, act) for _ in range(E))
        self.shared_experts = UpDownMLP(D, cfg.moe_shared_expert_intermediate_size, act, bias)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(D, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, D, bias=bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def route(self, h: torch.Tensor):
        """h [N, D] -> top-k weights [N, k] (fp32) and expert ids [N, k]."""
        scores = F.linear(h.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        N, E, G = h.shape[0], self.n_experts, self.n_group
        group_scores = choice.view(N, G, E // G).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        w, idx = self.route(h)
        hl = self.fc1_latent_proj(h) if self.fc1_latent_proj is not None else h
        out = torch.zeros(hl.shape, dtype=torch.float32, device=h.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, (self.experts[e](hl[tok]) * w[tok, slot, None]).float())
        out = out.to(h.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return (out + self.shared_experts(h)).view(shape)


def _mamba2(cfg) -> Mamba2Mixer:
    return Mamba2Mixer(
        cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups,
        cfg.conv_kernel, cfg.layer_norm_epsilon, proj_bias=cfg.use_bias, conv_bias=cfg.use_conv_bias,
        activation=cfg.mamba_hidden_act,
        # transformers' NemotronHMamba2Mixer: time_step_limit = (config.time_step_min, inf)
        dt_limit=(cfg.time_step_min, float("inf")),
    )


class NemotronHBlock(nn.Module):
    KINDS = {"linear_attention": "linear", "full_attention": "attention", "mlp": "mlp", "moe": "mlp"}

    def __init__(self, cfg, idx: int):
        super().__init__()
        block_type = cfg.layers_block_type[idx]
        if block_type not in self.KINDS:
            raise ValueError(f"nemotron_h: unsupported block type {block_type!r} at layer {idx}")
        self.block_type = block_type
        self.kind = self.KINDS[block_type]
        self.norm = FP32RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if block_type == "linear_attention":
            self.mixer = _mamba2(cfg)
        elif block_type == "full_attention":
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.mixer = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
        elif block_type == "mlp":
            self.mixer = UpDownMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)
        else:
            self.mixer = NemotronHMoE(cfg)

    def forward(self, x, state, ctx):
        h = self.norm(x)
        if self.kind == "mlp":
            return x + self.mixer(h), None
        h, state = ctx.mix(self.mixer, h, state)
        return x + h, state


class NemotronHLM(HybridLM):
    arch = "nemotron_h"
    checkpoint_prefixes = ("backbone.", "model.")
    embedding_name = "embeddings.weight"
    fp32_params = ("A_log", "dt_bias", "e_score_correction_bias")

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (NemotronHBlock(cfg, i) for i in range(len(cfg.layers_block_type))),
                   FP32RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon), tie=False,
                   embeddings="embeddings", final_norm="norm_f")

    # HybridLM's forward/logits use embed_tokens and norm; the checkpoint calls them so.
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.embeddings

    @property
    def norm(self) -> nn.Module:
        return self.norm_f
