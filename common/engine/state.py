"""Per-request model state: what a prefill leaves behind and a decode step continues from.

Per linear layer the short-conv tail and the recurrent state; per full-attention layer the keys
and values (already rotated to their positions). The state is explicit so that later stages can
compose, cache and ship it layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LinearLayerState:
    conv: torch.Tensor | None  # [B, C, kernel-1]: the last inputs of the short causal conv
    recurrent: torch.Tensor  # [B, H, K, V] fp32 (layout of kernels.linear_attn)

    def clone(self) -> "LinearLayerState":
        return LinearLayerState(
            None if self.conv is None else self.conv.clone(), self.recurrent.clone()
        )


@dataclass
class AttentionLayerState:
    keys: torch.Tensor  # [B, kv_heads, T, head_dim]
    values: torch.Tensor  # [B, kv_heads, T, v_head_dim]

    def clone(self) -> "AttentionLayerState":
        return AttentionLayerState(self.keys.clone(), self.values.clone())

    @property
    def length(self) -> int:
        return self.keys.shape[2]


LayerState = LinearLayerState | AttentionLayerState | None


@dataclass
class ModelState:
    """State of one sequence after `seq_len` tokens; `layers[i]` is None until layer i ran."""

    layers: list[LayerState]
    seq_len: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, num_layers: int) -> "ModelState":
        return cls(layers=[None] * num_layers, seq_len=0)

    def clone(self) -> "ModelState":
        return ModelState(
            layers=[None if s is None else s.clone() for s in self.layers],
            seq_len=self.seq_len,
            extra=dict(self.extra),
        )

    def nbytes(self) -> int:
        total = 0
        for s in self.layers:
            if isinstance(s, LinearLayerState):
                total += s.recurrent.numel() * s.recurrent.element_size()
                if s.conv is not None:
                    total += s.conv.numel() * s.conv.element_size()
            elif isinstance(s, AttentionLayerState):
                total += s.keys.numel() * s.keys.element_size() + s.values.numel() * s.values.element_size()
        return total


@dataclass
class PrefillOutput:
    """What a prefill returns: the next-token logits and the state to decode from."""

    logits: torch.Tensor  # [vocab] fp32, next-token logits after the last prompt token
    state: ModelState
    all_logits: torch.Tensor | None = None  # [T, vocab] when asked for
    extra: dict = field(default_factory=dict)  # timings, entries built, ... (common.engine.pic)
