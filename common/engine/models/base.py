"""What every hybrid model of ours has: embeddings, a stack of layers with explicit state, a head.

A layer is `forward(x [B,T,D], layer_state, ctx) -> (x, new_layer_state)`; it never mutates the
state it was given, so a caller may keep an old state (a cached prefix) and continue from it twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn

from common.engine.state import AttentionLayerState, LinearLayerState, ModelState


class LayerPlan(Protocol):
    """A forward pass that takes token mixing over (common.engine.pic.seam_plan.SeamPlan: all seams of all
    segments through one layer at once, between cached segment bodies)."""

    def run_linear(self, mixer: nn.Module, x: torch.Tensor,
                   ctx: "ForwardContext") -> tuple[torch.Tensor, LinearLayerState]:
        """A linear layer's mixer output [B, T, D] for x [B, T, D] and its state after the call."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx: "ForwardContext") -> tuple[torch.Tensor, AttentionLayerState]:
        """Attention output [B, T, heads, D] of rotated q, k, v [B, heads, T, D] and the layer's keys/values."""
        ...


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] absolute positions of the tokens in this call
    cache: dict = field(default_factory=dict)  # per-call memo (rotary cos/sin, ...)
    layer: int = -1  # index of the layer running now
    # Set by the batched (layer-major) seam recompute of common.engine.pic: it runs linear mixers itself
    # and lays out attention keys around cached segment bodies (see common.engine.layers.attention.attend).
    plan: LayerPlan | None = None
    # Called with each layer's index before the layer runs; it may raise to abandon the pass
    # (common.engine.pic.build.build_entry: a build nobody waits for any more stops between layers).
    before_layer: Callable[[int], None] | None = None

    def mix(self, mixer, x, state):
        """Layers call their token mixer through here so a plan can take the call over."""
        if self.plan is not None and getattr(mixer, "family", None) is not None:
            return self.plan.run_linear(mixer, x, self)
        return mixer(x, state, self)


class HybridLM(nn.Module):
    """Subclasses build `embed_tokens`, `layers`, `norm`, `lm_head` (or tie it) and set the fields
    below; the forward pass is the same for every architecture."""

    arch: str = "?"
    # Checkpoint name of our parameter `p` is prefix + p (lm_head.* is taken as is).
    checkpoint_prefixes: tuple[str, ...] = ("model.",)
    embedding_name: str = "embed_tokens.weight"
    # Parameters kept in fp32 whatever the model dtype (decay constants).
    fp32_params: tuple[str, ...] = ("A_log", "dt_bias")

    def __init__(self):
        super().__init__()
        self.tie_word_embeddings = False
        self.layer_kinds: list[str] = []  # per layer: "linear", "attention" or "mlp"
        self.vocab_size = 0

    def build(self, cfg, layers, norm: nn.Module, *, tie: bool | None = None,
              embeddings: str = "embed_tokens", final_norm: str = "norm"):
        """What every model's __init__ shares: the embeddings, the layers (an iterable, consumed
        after the embeddings are made) and their kinds, the final norm and the head. `tie` None
        reads config.tie_word_embeddings (default False); `embeddings` and `final_norm` are the
        attribute names the checkpoint uses."""
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        setattr(self, embeddings, nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.layer_kinds = [layer.kind for layer in self.layers]
        setattr(self, final_norm, norm)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False)) if tie is None else tie
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -- forward -----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, state: ModelState, ctx: ForwardContext | None = None,
                seq_len_after: int | None = None) -> tuple[torch.Tensor, ModelState]:
        """input_ids [B, T] -> (final hidden [B, T, D] after the last norm, new state)."""
        T = input_ids.shape[1]
        if ctx is None:
            ctx = ForwardContext(positions=torch.arange(state.seq_len, state.seq_len + T, device=input_ids.device))
        x = self.embed(input_ids)
        new_layers = list(state.layers)
        for i, layer in enumerate(self.layers):
            if ctx.before_layer is not None:
                ctx.before_layer(i)
            ctx.layer = i
            x, new_layers[i] = layer(x, state.layers[i], ctx)
        seq_len = state.seq_len + T if seq_len_after is None else seq_len_after
        new_state = ModelState(layers=new_layers, seq_len=seq_len, extra=dict(state.extra))
        return self.norm(x), new_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, w).float()

    # -- loading -----------------------------------------------------------------------------
    def checkpoint_name_fn(self, reader):
        prefix = next((p for p in self.checkpoint_prefixes if p + self.embedding_name in reader), None)
        if prefix is None:
            from common.engine.loader import CheckpointError

            raise CheckpointError(
                f"{self.arch}: checkpoint {reader.path} has no embedding weight "
                f"({' or '.join(p + self.embedding_name for p in self.checkpoint_prefixes)})"
            )

        def name_of(p: str) -> str | None:
            if p.startswith("lm_head."):
                return None if self.tie_word_embeddings else p
            return prefix + p

        return name_of
