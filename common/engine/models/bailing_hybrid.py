"""Ring / Ling 2.5 (bailing_hybrid): KDA linear layers + gated MLA attention, DeepSeek-style MoE.

Layer i is KDA or MLA per `config.layer_types` (one MLA layer closing every group of
`layer_group_size`); its MLP is dense or MoE per `config.mlp_layer_types`. Pre-norm blocks with
plain (Llama) RMSNorms. Checkpoint names (transformers' save_pretrained and the released models):
model.word_embeddings, model.layers.{i}.attention.* (both mixers; the output projection is `dense`),
model.layers.{i}.mlp.*, MoE router gate.weight and gate.expert_bias, experts.{e}.{gate,up,down}_proj.

KDA (kernels.linear_attn family "kda", the mixer common.engine.models.kimi_linear.KDAMixer): q, k,
v = silu(conv(q|k|v proj(x))) with q, k L2-normalised (fp32), beta = sigmoid(b_proj(x)), scale =
head_dim^-0.5, and a per-channel forget gate

    u = f_proj(x) + dt_bias            g = lower_bound * sigmoid(exp(A_log) * u)   (kda_safe_gate)
                                       g = -exp(A_log) * softplus(u)               (otherwise)

(rounded to the model dtype, as transformers does); output dense(RMSNorm(o) * sigmoid(g_proj(x))).

MLA (common.engine.layers.mla.LatentAttention, the one Kimi-Linear uses too): one q_proj (no q
LoRA), DeepSeek's interleaved-pair RoPE on the shared k_rot and on q_rot, a sigmoid output gate per
head (g_proj), output projection `dense`; the layer state (and a PIC entry) keeps the latents
[B,1,T,kv_lora_rank+rope], as the model's own KV cache would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers.mla import LatentAttention
from common.engine.layers.mlp import GatedMLP
from common.engine.layers.norm import RMSNorm
from common.engine.models.base import HybridLM
from common.engine.models.decoder import PreNormLayer, default_rotary, route_to_experts
from common.engine.models.kimi_linear import KDAMixer, KimiRouter


class BailingDeltaAttention(KDAMixer):
    """KDA mixer of Ring / Ling 2.5: full-rank forget and output gates (f_proj, g_proj), the
    forget gate optionally bounded (kda_safe_gate), output `dense`."""

    def __init__(self, cfg):
        super().__init__(cfg, "bailing_hybrid", out_proj="dense")
        self.safe_gate, self.lower_bound = bool(cfg.kda_safe_gate), float(cfg.kda_lower_bound)
        self.f_proj = nn.Linear(self.hidden, self.dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.dim))
        self.g_proj = nn.Linear(self.hidden, self.dim, bias=False)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [B,T,H,K] (fp32 values of the model dtype, in (lower_bound, 0))."""
        B, T, _ = x.shape
        u = self.f_proj(x).float().view(B, T, self.n_heads, self.head_dim)
        u = u + self.dt_bias.float().view(self.n_heads, self.head_dim)
        rate = self.A_log.float().exp().view(self.n_heads, 1)
        g = self.lower_bound * torch.sigmoid(rate * u) if self.safe_gate else -rate * F.softplus(u)
        return g.to(x.dtype).float()

    def out_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)


class BailingMoE(nn.Module):
    """Sigmoid router with a score-correction bias (checkpoint: gate.expert_bias) and grouped top-k
    (common.engine.models.kimi_linear.KimiRouter), SwiGLU experts and shared experts."""

    def __init__(self, cfg):
        super().__init__()
        E, D = cfg.num_local_experts, cfg.hidden_size
        self.gate = KimiRouter(D, E, cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1,
                               bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))
        self.experts = nn.ModuleList(GatedMLP(D, cfg.moe_intermediate_size, cfg.hidden_act) for _ in range(E))
        self.shared_experts = GatedMLP(D, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        w, idx = self.gate(h)
        out = route_to_experts(h, w, idx, lambda e, t: self.experts[e](t))
        return (out + self.shared_experts(h)).view(shape)


class BailingLayer(PreNormLayer):
    MIXER = {"linear": "attention", "attention": "attention"}  # both mixers: the checkpoint's "attention"

    def __init__(self, cfg, idx: int):
        super().__init__()
        self.kind = "attention" if cfg.layer_types[idx] == "full_attention" else "linear"
        self.attention = (LatentAttention(cfg, default_rotary(cfg, cfg.qk_rope_head_dim, "bailing_hybrid"),
                                          output_gate=True, out_proj="dense")
                          if self.kind == "attention" else BailingDeltaAttention(cfg))
        sparse = cfg.mlp_layer_types[idx] == "sparse"
        self.mlp = BailingMoE(cfg) if sparse else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BailingHybridLM(HybridLM):
    arch = "bailing_hybrid"
    checkpoint_prefixes = ("model.",)
    embedding_name = "word_embeddings.weight"
    fp32_params = ("A_log", "dt_bias", "e_score_correction_bias")

    def __init__(self, cfg):
        super().__init__()
        # the MTP layers past num_hidden_layers (training only) are left in the checkpoint
        self.build(cfg, (BailingLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), embeddings="word_embeddings")

    @property
    def embed_tokens(self) -> nn.Embedding:  # HybridLM's name; the checkpoint says word_embeddings
        return self.word_embeddings

    def checkpoint_name_fn(self, reader):
        base = super().checkpoint_name_fn(reader)

        def name_of(p: str) -> str | None:
            name = base(p)
            if name is not None and name.endswith(".gate.e_score_correction_bias"):
                name = name[: -len("e_score_correction_bias")] + "expert_bias"
            return name

        return name_of
