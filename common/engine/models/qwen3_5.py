"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet + gated full attention.

Layer i is linear (GDN) or full attention per `config.layer_types`; full attention has an output
gate, q/k RMSNorm and partial RoPE; norms are zero-centred (x * (1 + w)). Qwen3-Next fuses the
GDN projections (in_proj_qkvz, in_proj_ba) grouped per key head; Qwen3.5 keeps them separate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.attention import attend
from common.engine.layers.conv import causal_conv
from common.engine.layers.mlp import GatedMLP, QwenSparseMoe
from common.engine.layers.norm import GatedRMSNorm, RMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import ForwardContext, HybridLM
from common.engine.models.decoder import ChunkedLinearMixer, PreNormLayer
from kernels.linear_attn import operand_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(ChunkedLinearMixer):
    """Qwen3.5 GDN mixer. The recurrence runs in kernels.linear_attn ("gated_deltanet")."""

    family = "gated_deltanet"

    def __init__(self, cfg):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = self.conv_kernel = cfg.linear_conv_kernel_dim
        self.scale = self.dk**-0.5
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.n_v))
        self.A_log = nn.Parameter(torch.empty(self.n_v))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden, bias=False)
        self._build_projections(cfg)

    def _build_projections(self, cfg):
        self.in_proj_qkv = nn.Linear(self.hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(self.hidden, self.n_v, bias=False)

    def project(self, x):
        """x [B,T,D] -> conv input [B,T,conv_dim] (q|k|v), z [B,T,Hv,dv], b, a [B,T,Hv]."""
        B, T, _ = x.shape
        z = self.in_proj_z(x).view(B, T, self.n_v, self.dv)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The channels that enter the short conv, [B, T, conv_dim]."""
        return self.project(x)[0]

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None):
        """Everything before the recurrence: (q, k, v, g, beta, z, new conv tail).

        q, k [B,T,Hv,dk] (l2-normalised in fp32, repeated to the value heads) in the kernels'
        operand dtype (fp32 on the torch path, the model's on fla), v [B,T,Hv,dv],
        g [B,T,Hv] log-decay, beta [B,T,Hv]; z is what `output` needs besides o.
        """
        B, T, _ = x.shape
        mixed, z, b, a = self.project(x)
        mixed, tail = causal_conv(mixed.transpose(1, 2), self.conv1d.weight.squeeze(1), None, conv_tail)
        q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # l2norm in fp32, handed on in the kernels' operand dtype (fp32 on the torch path)
        dt = operand_dtype(x.device, x.dtype)
        q = l2norm(q.reshape(B, T, self.n_k, self.dk).float()).to(dt)
        k = l2norm(k.reshape(B, T, self.n_k, self.dk).float()).to(dt)
        v = v.reshape(B, T, self.n_v, self.dv)
        if self.n_v != self.n_k:
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta, z, tail

    def output(self, o: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        B, T = o.shape[:2]
        o = self.norm(o.to(dtype), z)
        return self.out_proj(o.reshape(B, T, self.value_dim))


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: q,k,v,z and b,a come from two fused projections, grouped per key head."""

    def _build_projections(self, cfg):
        self.in_proj_qkvz = nn.Linear(self.hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden, 2 * self.n_v, bias=False)

    def project(self, x):
        B, T, _ = x.shape
        r = self.n_v // self.n_k
        qkvz = self.in_proj_qkvz(x).view(B, T, self.n_k, 2 * self.dk + 2 * r * self.dv)
        ba = self.in_proj_ba(x).view(B, T, self.n_k, 2 * r)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=3)
        b, a = torch.split(ba, [r, r], dim=3)
        mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(B, T, self.n_v, self.dv), b.reshape(B, T, self.n_v), a.reshape(B, T, self.n_v)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, q/k RMSNorm (zero-centred) and partial RoPE."""

    def __init__(self, cfg):
        super().__init__()
        self.n_q, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_q
        bias = getattr(cfg, "attention_bias", False)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_q * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(self.head_dim, theta, partial)
        self.scale = self.head_dim**-0.5

    def qkv(self, x, positions):
        """Projected, normed, rotated q [B,Hq,T,D], k, v [B,Hkv,T,D] and the gate [B,T,Hq*D]."""
        B, T, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(B, T, self.n_q, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v, gate.reshape(B, T, -1)

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated at positions p -> the same keys at p + delta (R(p+d) = R(d) R(p))."""
        return self.rotary.rerotate(keys, delta)

    def forward(self, x, state, ctx: ForwardContext):
        B, T, _ = x.shape
        q, k, v, gate = self.qkv(x, ctx.positions)
        o, new_state = attend(q, k, v, state, self.scale, ctx)
        return self.o_proj(o.reshape(B, T, -1) * torch.sigmoid(gate)), new_state


class DecoderLayer(PreNormLayer):
    MIXER = {"linear": "linear_attn", "attention": "self_attn"}

    def __init__(self, cfg, idx: int, fused: bool):
        super().__init__()
        self.kind = "linear" if cfg.layer_types[idx] == "linear_attention" else "attention"
        if self.kind == "linear":
            self.linear_attn = (FusedGatedDeltaNet if fused else GatedDeltaNet)(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        num_experts = getattr(cfg, "num_experts", 0) or 0
        sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if num_experts > 0 and idx not in (getattr(cfg, "mlp_only_layers", None) or []) and (idx + 1) % sparse_step == 0:
            self.mlp = QwenSparseMoe(
                cfg.hidden_size, num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size, getattr(cfg, "norm_topk_prob", True), cfg.hidden_act,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)


class Qwen35LM(HybridLM):
    arch = "qwen3_5"
    checkpoint_prefixes = ("model.", "model.language_model.")
    fused_projections = False

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (DecoderLayer(cfg, i, self.fused_projections) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True))


class Qwen3NextLM(Qwen35LM):
    arch = "qwen3_next"
    checkpoint_prefixes = ("model.",)
    fused_projections = True
