"""Zamba2 (Zyphra): Mamba2 layers; before some of them ("hybrid" layers) a transformer block
whose weights are SHARED across depths (num_mem_blocks copies, used in turn), made per-depth by
small LoRA adapters on q/k/v and on the MLP's gate_up projection.

    hybrid layer L (its k-th hybrid layer uses shared block k % num_mem_blocks, adapter slot k):
        a = attention_k(input_layernorm([x ; e]))      e = the token embeddings, width 2D
        t = linear_L(mlp_k(pre_ff_layernorm(a)))
        x = x + mamba_L(norm_L(x + t))
    mamba layer L:  x = x + mamba_L(norm_L(x))

The attention runs on width 2D (head_dim = 2D / heads, softmax scale (head_dim / 2)^-1/2, RoPE
when use_mem_rope). Each hybrid layer has its OWN key/value state (the weights are shared, the
inputs are not), so for PIC a hybrid layer is two of our layers:
    "attention": the shared block at its slot -> t (kept in ctx.cache; x passes unchanged),
    "linear":    x + mamba(norm(x + t)).
Both compose exactly (keys rotated by RoPE are rerotated on reuse; Mamba2 through T).

Checkpoint names (transformers saves a shared block once, under its first hybrid layer):
model.layers.{L}.shared_transformer.*, .linear, .mamba_decoder.{mamba,input_layernorm} for a
hybrid layer, model.layers.{L}.{mamba,input_layernorm} for a Mamba layer, model.final_layernorm,
lm_head (tied by default).
"""
from __future__ import annotations

import torch
from torch import nn

from common.engine.layers.attention import attend
from common.engine.layers.mamba2 import Mamba2Mixer
from common.engine.layers.mlp import activation
from common.engine.layers.norm import RMSNorm
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import ForwardContext, HybridLM

_EMBEDDINGS = "zamba2.embeddings"
_BLOCK_OUT = "zamba2.block_out"


def _lora(n_in: int, rank: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, rank, bias=False), nn.Linear(rank, n_out, bias=False))


def _adapters(cfg, block_id: int, n_in: int, n_out: int) -> nn.ModuleList:
    """One slot per hybrid layer; only the slots this block serves hold a LoRA (transformers' layout)."""
    n = len(cfg.hybrid_layer_ids)
    return nn.ModuleList(_lora(n_in, cfg.adapter_rank, n_out) if i % cfg.num_mem_blocks == block_id
                         else nn.Identity() for i in range(n))


class SharedAttention(nn.Module):
    def __init__(self, cfg, block_id: int):
        super().__init__()
        A, hd = cfg.attention_hidden_size, cfg.attention_head_dim
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.input_size = A  # the shared blocks read [hidden; embeddings]
        self.q_proj = nn.Linear(A, self.n_q * hd, bias=False)
        self.k_proj = nn.Linear(A, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(A, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_q * hd, cfg.hidden_size, bias=False)
        self.has_adapters = bool(cfg.use_shared_attention_adapter)
        if self.has_adapters:
            self.linear_q_adapter_list = _adapters(cfg, block_id, A, A)
            self.linear_k_adapter_list = _adapters(cfg, block_id, A, A)
            self.linear_v_adapter_list = _adapters(cfg, block_id, A, A)
        self.rotary = None
        if cfg.use_mem_rope:
            rope = getattr(cfg, "rope_parameters", None) or {}
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"zamba2: unsupported rope_type {rope.get('rope_type')!r}")
            self.rotary = RotaryEmbedding(hd, rope.get("rope_theta", 10000.0))
        self.scale = (hd / 2) ** -0.5

    def qkv(self, x, positions, slot: int = 0):
        """q, k, v [B, heads, T, head_dim] of x at `positions` through the adapters of `slot`."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.has_adapters:
            q = q + self.linear_q_adapter_list[slot](x)
            k = k + self.linear_k_adapter_list[slot](x)
            v = v + self.linear_v_adapter_list[slot](x)
        q = q.view(B, T, self.n_q, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, q.dtype)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v

    def forward(self, x, state, ctx, slot: int):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx.positions, slot)
        o, new_state = attend(q, k, v, state, self.scale, ctx)
        return self.o_proj(o.reshape(B, T, -1)), new_state

    def rerotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        return keys if self.rotary is None else self.rotary.rerotate(keys, delta)


class SharedMLP(nn.Module):
    def __init__(self, cfg, block_id: int):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(D, 2 * I, bias=cfg.add_bias_linear)
        self.down_proj = nn.Linear(I, D, bias=cfg.add_bias_linear)
        self.gate_up_proj_adapter_list = _adapters(cfg, block_id, D, 2 * I)
        self.act = activation(cfg.hidden_act)

    def forward(self, x, slot: int):
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[slot](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SharedBlock(nn.Module):
    """transformers' Zamba2AttentionDecoderLayer: one set of weights, used at several depths."""

    def __init__(self, cfg, block_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.attention_hidden_size, cfg.rms_norm_eps)
        self.self_attn = SharedAttention(cfg, block_id)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = SharedMLP(cfg, block_id)


class AttentionAtSlot:
    """The attention mixer of one hybrid layer: the shared weights with that layer's adapters.
    A plain object (not a Module) so that the shared weights are registered once."""

    def __init__(self, attn: SharedAttention, slot: int):
        self.attn, self.slot = attn, slot
        self.input_size = attn.input_size  # [hidden; embeddings], as the shared block reads it

    def __call__(self, x, state, ctx):
        return self.attn(x, state, ctx, self.slot)

    def rerotate(self, keys, delta):
        return self.attn.rerotate(keys, delta)


class Zamba2BlockPart(nn.Module):
    """The shared transformer block of hybrid layer L (kind "attention"); x passes unchanged."""

    kind = "attention"

    def __init__(self, cfg, block: SharedBlock, slot: int):
        super().__init__()
        self.shared_transformer = block
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.slot = slot
        self._mixer = AttentionAtSlot(block.self_attn, slot)

    @property
    def mixer(self):
        return self._mixer

    def forward(self, x, state, ctx):
        blk = self.shared_transformer
        h = blk.input_layernorm(torch.cat([x, ctx.cache[_EMBEDDINGS]], dim=-1))
        a, new_state = ctx.mix(self._mixer, h, state)
        ctx.cache[(_BLOCK_OUT, ctx.layer)] = self.linear(blk.feed_forward(blk.pre_ff_layernorm(a), self.slot))
        return x, new_state


class Zamba2MambaPart(nn.Module):
    """x + mamba(norm(x [+ the preceding block's output])) (kind "linear")."""

    kind = "linear"

    def __init__(self, cfg, after_block: bool):
        super().__init__()
        self.after_block = after_block
        self.mamba = Mamba2Mixer(
            cfg.hidden_size, cfg.n_mamba_heads, cfg.mamba_headdim, cfg.mamba_d_state, cfg.mamba_ngroups,
            cfg.mamba_d_conv, 1e-5,  # transformers' Zamba2RMSNormGated eps is fixed at 1e-5
            proj_bias=cfg.add_bias_linear, conv_bias=True, activation="silu",
            dt_limit=(cfg.time_step_min, float("inf")),
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self):
        return self.mamba

    def forward(self, x, state, ctx):
        h = x + ctx.cache.pop((_BLOCK_OUT, ctx.layer - 1)) if self.after_block else x
        m, new_state = ctx.mix(self.mamba, self.input_layernorm(h), state)
        return x + m, new_state


class Zamba2LM(HybridLM):
    arch = "zamba2"
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg):
        super().__init__()
        self.source = []  # source[j] = (transformers layer index, "block" | "mamba" | "hybrid mamba")
        self.build(cfg, self._parts(cfg), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                   tie=bool(getattr(cfg, "tie_word_embeddings", True)), final_norm="final_layernorm")

    def _parts(self, cfg):
        """Our layers in order (a hybrid layer is a block part then a Mamba part), noting each one's source."""
        blocks = [SharedBlock(cfg, b) for b in range(min(cfg.num_mem_blocks, len(cfg.hybrid_layer_ids)))]
        for L, kind in enumerate(cfg.layers_block_type):
            if kind == "hybrid":
                slot = cfg.hybrid_layer_ids.index(L)
                self.source.append((L, "block"))
                yield Zamba2BlockPart(cfg, blocks[slot % cfg.num_mem_blocks], slot)
            elif kind not in ("mamba", "linear_attention"):
                raise ValueError(f"zamba2: unsupported layer type {kind!r} at layer {L}")
            self.source.append((L, "hybrid mamba" if kind == "hybrid" else "mamba"))
            yield Zamba2MambaPart(cfg, after_block=kind == "hybrid")

    @property
    def norm(self) -> nn.Module:
        return self.final_layernorm

    def forward(self, input_ids, state, ctx: ForwardContext | None = None, seq_len_after: int | None = None):
        if ctx is None:
            T = input_ids.shape[1]
            ctx = ForwardContext(positions=torch.arange(state.seq_len, state.seq_len + T, device=input_ids.device))
        # every shared block reads the token embeddings next to the running hidden state
        ctx.cache[_EMBEDDINGS] = self.embed(input_ids)
        return super().forward(input_ids, state, ctx, seq_len_after)

    def checkpoint_name_fn(self, reader):
        name_of = super().checkpoint_name_fn(reader)

        def zamba_name(p: str) -> str | None:
            if p.startswith("layers."):
                _, j, rest = p.split(".", 2)
                L, what = self.source[int(j)]
                p = f"layers.{L}.{'mamba_decoder.' if what == 'hybrid mamba' else ''}{rest}"
            return name_of(p)

        return zamba_name
