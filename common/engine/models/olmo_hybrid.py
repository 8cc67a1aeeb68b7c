"""OLMo hybrid (olmo_hybrid): Gated DeltaNet layers (negative eigenvalues allowed) + OLMo-3 attention.

Linear layers are GDN (kernels.linear_attn family "gated_deltanet") with fully separate q/k/v/a/b/g
projections and q/k/v short convs. With `linear_allow_neg_eigval` (the default) beta = 2 sigmoid(b)
lies in (0, 2): the eigenvalue 1 - beta of I - beta k k^T lies in (-1, 1), so the transition T of
a segment may flip signs and no longer contracts monotonically — composition is still exact
(T is the same K x K product), but errors in a cached T are not damped by it.

    q, k, v = silu(conv(q|k|v proj(x)));  q, k l2-normalised (fp32), repeated to the value heads
    g = -exp(A_log) softplus(a_proj(x) + dt_bias);   scale = d_k^-0.5
    out = o_proj(RMSNorm_eps1e-5(o) * silu(g_proj(x)))        (per value head)

Attention layers (OLMo-3 style, post-norm): x + post_attention_layernorm(attn(x)) and
x + post_feedforward_layernorm(mlp(x)), q/k RMSNorm over all heads before the head split, RoPE
unless the config's rope_theta is None (the released checkpoints: NoPE). Linear layers are
pre-norm: x + mixer(input_layernorm(x)), x + mlp(post_attention_layernorm(x)).

Checkpoint names are transformers' with its renaming undone: input_layernorm is
`attention_layer_norm`, post_attention_layernorm `feedforward_layer_norm` (in both layer kinds),
and the short conv is stored as three tensors q_conv1d, k_conv1d, v_conv1d, concatenated here into
one conv over q|k|v. Concatenating (rather than reading each at its own size) loads both layouts in
circulation: the original [key_dim], [key_dim], [value_dim] and transformers' save_pretrained, which
splits the fused conv into three equal thirds whatever the dims.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.attention import attend
from common.engine.layers.conv import causal_conv
from common.engine.layers.mlp import GatedMLP
from common.engine.layers.norm import GatedRMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import ForwardContext, HybridLM
from common.engine.models.decoder import ChunkedLinearMixer, PreNormLayer
from common.engine.models.nemotron_h import FP32RMSNorm
from common.engine.models.qwen3_5 import l2norm


class OlmoGatedDeltaNet(ChunkedLinearMixer):
    family = "gated_deltanet"

    def __init__(self, cfg):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.kernel = self.conv_kernel = cfg.linear_conv_kernel_dim
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"olmo_hybrid: unsupported conv activation {cfg.hidden_act!r}")
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0
        D, kd, vd = self.hidden, self.key_dim, self.value_dim
        self.q_proj = nn.Linear(D, kd, bias=False)
        self.k_proj = nn.Linear(D, kd, bias=False)
        self.v_proj = nn.Linear(D, vd, bias=False)
        self.conv_dim = 2 * kd + vd
        # one depthwise conv over q|k|v; the checkpoint stores it as q_conv1d, k_conv1d, v_conv1d
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.a_proj = nn.Linear(D, self.n_v, bias=False)
        self.b_proj = nn.Linear(D, self.n_v, bias=False)
        self.g_proj = nn.Linear(D, vd, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_v))
        self.dt_bias = nn.Parameter(torch.empty(self.n_v))
        self.o_norm = GatedRMSNorm(self.dv, eps=1e-5)  # transformers: FLA's FusedRMSNormGated default eps
        self.o_proj = nn.Linear(vd, D, bias=False)
        self.scale = self.dk**-0.5

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The channels that enter the short conv (q|k|v), [B, T, 2*key_dim + value_dim]."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None):
        """(q, k [B,T,Hv,dk] fp32 l2-normalised, v [B,T,Hv,dv], g [B,T,Hv] fp32, beta [B,T,Hv] in
        (0, beta_scale), x (for the output gate), new conv tail)."""
        B, T, _ = x.shape
        mixed, tail = causal_conv(self.conv_inputs(x).transpose(1, 2), self.conv1d.weight.squeeze(1), None,
                                   conv_tail)
        q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(B, T, self.n_k, self.dk).float())
        k = l2norm(k.reshape(B, T, self.n_k, self.dk).float())
        v = v.reshape(B, T, self.n_v, self.dv)
        if self.n_v != self.n_k:
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        beta = self.b_proj(x).sigmoid().float() * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        return q, k, v, g, beta, x, tail

    def output(self, o: torch.Tensor, x: torch.Tensor, dtype) -> torch.Tensor:
        B, T = o.shape[:2]
        gate = self.g_proj(x).view(B, T, self.n_v, self.dv)
        o = self.o_norm(o.to(dtype), gate)
        return self.o_proj(o.reshape(B, T, self.value_dim))


class OlmoAttention(nn.Module):
    """GQA with q/k RMSNorm over all heads (fp32 weight multiply) and optional full-head RoPE."""

    def __init__(self, cfg):
        super().__init__()
        self.n_q, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_q
        D, bias = cfg.hidden_size, bool(cfg.attention_bias)
        self.q_proj = nn.Linear(D, self.n_q * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, D, bias=bias)
        self.q_norm = FP32RMSNorm(self.n_q * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = FP32RMSNorm(self.n_kv * self.head_dim, cfg.rms_norm_eps)
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_theta") is None:
            self.rotary = None  # NoPE (the released checkpoints)
        elif rope.get("rope_type", "default") != "default":
            raise ValueError(f"olmo_hybrid: unsupported rope_type {rope.get('rope_type')!r}")
        else:
            self.rotary = RotaryEmbedding(self.head_dim, rope["rope_theta"])
        self.scale = self.head_dim**-0.5

    def qkv(self, x, positions):
        """q, k, v [B, heads, T, head_dim] of x at `positions` (keys rotated when RoPE is on)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(B, T, self.n_q, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            # transformers keeps OLMo's cos/sin in fp32 whatever the model dtype
            cos, sin = self.rotary.cos_sin(positions, torch.float32)
            q = self.rotary.apply(q, cos, sin).to(v.dtype)
            k = self.rotary.apply(k, cos, sin).to(v.dtype)
        return q, k, v

    def forward(self, x, state, ctx: ForwardContext):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx.positions)
        o, new_state = attend(q, k, v, state, self.scale, ctx)
        return self.o_proj(o.reshape(B, T, -1)), new_state

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        if self.rotary is None:
            return keys
        return self.rotary.rerotate(keys.float(), delta).to(keys.dtype)


class OlmoHybridLayer(PreNormLayer):
    """Linear layers: PreNormLayer; attention layers: post-norm (OLMo-3)."""

    MIXER = {"linear": "linear_attn", "attention": "self_attn"}

    def __init__(self, cfg, idx: int):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = "linear" if cfg.layer_types[idx] == "linear_attention" else "attention"
        self.mlp = GatedMLP(D, cfg.intermediate_size, cfg.hidden_act)
        self.post_attention_layernorm = FP32RMSNorm(D, eps)
        if self.kind == "linear":
            self.linear_attn = OlmoGatedDeltaNet(cfg)
            self.input_layernorm = FP32RMSNorm(D, eps)
        else:
            self.self_attn = OlmoAttention(cfg)
            self.post_feedforward_layernorm = FP32RMSNorm(D, eps)

    def forward(self, x, state, ctx):
        if self.kind == "linear":
            return super().forward(x, state, ctx)
        h, new_state = ctx.mix(self.mixer, x, state)  # post-norm
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(x)), new_state


class OlmoHybridLM(HybridLM):
    arch = "olmo_hybrid"
    checkpoint_prefixes = ("model.",)
    # transformers' renaming (conversion_mapping "olmo_hybrid"), undone for the checkpoint's names
    RENAMES = {".input_layernorm.": ".attention_layer_norm.", ".post_attention_layernorm.": ".feedforward_layer_norm."}

    def __init__(self, cfg):
        super().__init__()
        self.build(cfg, (OlmoHybridLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   FP32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def checkpoint_name_fn(self, reader):
        base = super().checkpoint_name_fn(reader)

        def name_of(p: str) -> str | tuple[str, ...] | None:
            name = base(p)
            if name is not None and name.endswith(".linear_attn.conv1d.weight"):
                stem = name[: -len("conv1d.weight")]
                return tuple(f"{stem}{part}_conv1d.weight" for part in "qkv")
            for ours, theirs in self.RENAMES.items():
                if name is not None and ours in name:
                    name = name.replace(ours, theirs)
            return name

        return name_of
