"""Kimi-Linear: KDA (Kimi Delta Attention) linear layers + MLA full attention without RoPE.

Layer i is KDA or MLA per `config.layer_types`; its MLP is dense or a DeepSeek-V3-style MoE
(sigmoid router with a score-correction bias, grouped top-k, routed scaling, shared experts) per
`config.mlp_layer_types`. Norms are plain (Llama) RMSNorms. Parameter names follow the original
Moonshot checkpoints (what transformers' `save_pretrained` writes too): both mixers live under
`self_attn.`, KDA keeps separate q/k/v short convs and its forget-gate weights directly in
`self_attn.`, experts are `experts.{e}.w1/w2/w3`, and MLPs sit under `mlp.` or `block_sparse_moe.`
(real checkpoints: dense `mlp.`, MoE `block_sparse_moe.`; transformers' export: all
`block_sparse_moe.`) — the loader takes whichever the checkpoint has, per layer.

KDA recurrence (kernels.linear_attn family "kda"): q, k are L2-normalised here (fp32), the gate is
a per-channel log-decay g [B,T,H,K] = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta =
sigmoid(b_proj(x)), scale = head_dim^-0.5. The output goes through an RMSNorm gated by a *sigmoid*
(not SiLU) of g_b(g_a(x)).

MLA (common.engine.layers.mla.LatentAttention, the one bailing_hybrid uses too): no rotary (k_rot
is the raw projection), optional q LoRA, no output gate, output projection `o_proj`; the layer state
(and so a PIC entry) keeps what the model's own KV cache holds, the normed latent c and k_rot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.conv import causal_conv
from common.engine.layers.mla import LatentAttention
from common.engine.layers.mlp import GatedMLP, activation
from common.engine.layers.norm import RMSNorm
from common.engine.models.base import HybridLM
from common.engine.models.decoder import ChunkedLinearMixer, PreNormLayer, route_to_experts
from kernels.linear_attn import operand_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm (as transformers' KDA fallback): x / sqrt(sum x^2 + eps)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class SigmoidGatedRMSNorm(nn.Module):
    """KDA output norm: fp32 RMSNorm, fp32 weight, times sigmoid(gate), cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h
        return (h * torch.sigmoid(gate.float())).to(dtype)


class KDAMixer(ChunkedLinearMixer):
    """The KDA mixer Kimi-Linear and bailing_hybrid share: q|k|v projections through separate
    depthwise short convs (the checkpoints' layout; run as one conv over q|k|v) with SiLU, q and k
    L2-normalised in fp32, beta = sigmoid(b_proj(x)), scale = head_dim^-0.5, the output through
    an RMSNorm gated by a sigmoid of the output gate. A model's subclass gives the forget gate
    `gate(x)`, the output gate `out_gate(x)` and the output projection's checkpoint name."""

    family = "kda"

    def __init__(self, cfg, arch: str, out_proj: str):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        self.dim = d = self.n_heads * self.head_dim
        self.kernel = self.conv_kernel = cfg.linear_conv_kernel_dim
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"{arch}: unsupported KDA conv activation {cfg.hidden_act!r}")
        self.q_proj = nn.Linear(self.hidden, d, bias=False)
        self.k_proj = nn.Linear(self.hidden, d, bias=False)
        self.v_proj = nn.Linear(self.hidden, d, bias=False)
        self.q_conv1d = nn.Conv1d(d, d, self.kernel, groups=d, bias=False)
        self.k_conv1d = nn.Conv1d(d, d, self.kernel, groups=d, bias=False)
        self.v_conv1d = nn.Conv1d(d, d, self.kernel, groups=d, bias=False)
        self.b_proj = nn.Linear(self.hidden, self.n_heads, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.out_proj_name = out_proj  # the parameter's name is the checkpoint's
        setattr(self, out_proj, nn.Linear(d, self.hidden, bias=False))
        self.scale = self.head_dim**-0.5

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [B,T,H,K] (fp32, <= 0)."""
        raise NotImplementedError

    def out_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output norm's gate [B,T,dim] (model dtype)."""
        raise NotImplementedError

    def conv_weight(self) -> torch.Tensor:
        """[3*dim, kernel]: the q, k, v short-conv weights stacked (channel order q|k|v)."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).squeeze(1)

    def conv_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The channels that enter the short convs (q|k|v), [B, T, 3*dim]."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def features(self, x: torch.Tensor, conv_tail: torch.Tensor | None):
        """Everything before the recurrence: (q, k, v, g, beta, out_gate, new conv tail).

        q, k [B,T,H,K] L2-normalised in fp32, in the kernels' operand dtype; v [B,T,H,V] (model
        dtype); g [B,T,H,K] fp32 log-decay; beta [B,T,H] fp32; out_gate [B,T,H,V] (model dtype);
        tail [B, 3*dim, kernel-1].
        """
        B, T, _ = x.shape
        mixed, tail = causal_conv(self.conv_inputs(x).transpose(1, 2), self.conv_weight(), None, conv_tail, act="silu")
        q, k, v = torch.split(mixed.transpose(1, 2), [self.dim] * 3, dim=-1)
        shape = (B, T, self.n_heads, self.head_dim)
        dt = operand_dtype(x.device, x.dtype)  # fp32 on the torch path, the model's on fla
        q = l2norm(q.reshape(shape).float()).to(dt)
        k = l2norm(k.reshape(shape).float()).to(dt)
        beta = torch.sigmoid(self.b_proj(x)).float()  # in the model dtype, as transformers does
        return q, k, v.reshape(shape), self.gate(x), beta, self.out_gate(x).view(shape), tail

    def output(self, o: torch.Tensor, out_gate: torch.Tensor, dtype) -> torch.Tensor:
        B, T = o.shape[:2]
        o = self.o_norm(o.to(dtype), out_gate)
        return getattr(self, self.out_proj_name)(o.reshape(B, T, self.dim))


class KimiDeltaAttention(KDAMixer):
    """Kimi-Linear's KDA: low-rank forget and output gates (f_a/f_b, g_a/g_b), output o_proj."""

    def __init__(self, cfg):
        super().__init__(cfg, "kimi_linear", out_proj="o_proj")
        d, hd = self.dim, self.head_dim
        self.f_a_proj = nn.Linear(self.hidden, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, d, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d))
        self.A_log = nn.Parameter(torch.empty(1, 1, self.n_heads, 1))
        self.g_a_proj = nn.Linear(self.hidden, hd, bias=False)
        self.g_b_proj = nn.Linear(hd, d, bias=False)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = g.view(B, T, self.n_heads, self.head_dim)
        # transformers' softplus: identity above 20, log(1 + exp(g)) below.
        sp = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -self.A_log.float().exp() * sp

    def out_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(x))


class KimiExpert(nn.Module):
    """One routed expert: w2(act(w1 x) * w3 x) (checkpoint names experts.{e}.w1/w2/w3)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class KimiRouter(nn.Module):
    """Sigmoid scores; choice by score + e_score_correction_bias within the top `topk_group` of
    `n_group` groups (a group scores the sum of its top two); weights are the raw scores of the
    chosen experts, renormalised if asked, times routed_scaling_factor."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, D] -> (weights [N, top_k] fp32, expert indices [N, top_k])."""
        scores = F.linear(h.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        N, E, G = h.shape[0], self.num_experts, self.n_group
        if G > 1:
            group_scores = choice.view(N, G, E // G).topk(2, dim=-1)[0].sum(-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class KimiSparseMoe(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E = cfg.num_local_experts
        self.gate = KimiRouter(
            cfg.hidden_size, E, cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1,
            bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor),
        )
        self.experts = nn.ModuleList(
            KimiExpert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act) for _ in range(E)
        )
        shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        w, idx = self.gate(h)
        out = route_to_experts(h, w, idx, lambda e, t: self.experts[e](t))
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out.view(shape)


class DecoderLayer(PreNormLayer):  # both mixers live under self_attn (the checkpoint's name)
    def __init__(self, cfg, idx: int):
        super().__init__()
        self.kind = "attention" if cfg.layer_types[idx] == "full_attention" else "linear"
        self.self_attn = LatentAttention(cfg) if self.kind == "attention" else KimiDeltaAttention(cfg)
        mlp_types = getattr(cfg, "mlp_layer_types", None)
        self.sparse = bool(mlp_types) and mlp_types[idx] == "sparse"
        self.mlp = KimiSparseMoe(cfg) if self.sparse else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearLM(HybridLM):
    arch = "kimi_linear"
    checkpoint_prefixes = ("model.",)
    fp32_params = ("A_log", "dt_bias", "e_score_correction_bias")

    def __init__(self, cfg):
        super().__init__()
        # transformers' KimiLinearForCausalLM never ties the head (_tied_weights_keys = {}).
        self.build(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), tie=False)

    def checkpoint_name_fn(self, reader):
        base = super().checkpoint_name_fn(reader)
        # Per layer, the MLP's checkpoint prefix: "block_sparse_moe." if the checkpoint has any
        # tensor there for that layer, else "mlp.".
        moe_layers = {k.split(".")[2] for k in reader.keys() if k.startswith("model.layers.") and ".block_sparse_moe." in k}

        def name_of(p: str) -> str | None:
            name = base(p)
            parts = p.split(".")
            if len(parts) > 2 and parts[0] == "layers" and parts[2] == "mlp" and parts[1] in moe_layers:
                name = name.replace(f"layers.{parts[1]}.mlp.", f"layers.{parts[1]}.block_sparse_moe.", 1)
            return name

        return name_of
