"""Applying a segment's cached body to a running state (docs/design.md §3): a linear layer runs the
body's warm-up tokens with the real conv state, then S := T_body . S + S_body and conv := body tail;
an attention layer appends the body's keys rotated to their real positions. Shared by the
segment-major order (apply_body) and the layer-major SeamPlan (run_warmup, conv_cat).
"""
from __future__ import annotations

import torch

from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.compose import compose_summary as compose  # Triton on CUDA, torch on CPU (one chooser)
from kernels.linear_attn import linear_attention


def conv_cat(tail: torch.Tensor, new: torch.Tensor | None, width: int) -> torch.Tensor:
    """The conv state after `tail` then the inputs `new` [.., C, n]: the last `width` of them."""
    if new is None or new.shape[-1] == 0:
        return tail
    return torch.cat([tail.to(new.dtype), new], dim=-1)[..., -width:] if width > 0 else tail


def run_warmup(mixer, body: LinearBody, S: torch.Tensor, conv: torch.Tensor | None) -> torch.Tensor:
    """Advance S over the body's warm-up tokens with the real conv state (exact conv patch)."""
    if body.warmup_inputs is None:
        return S
    x = body.warmup_inputs.to(mixer_dtype(mixer))
    q, k, v, g, beta, _aux, _ = mixer.features(x, conv)
    _, S = linear_attention(mixer.family, q, k, v, g=g, beta=beta, initial_state=S, scale=mixer.scale)
    return S


def mixer_dtype(mixer) -> torch.dtype:
    """The dtype the mixer's inputs are in: its weight matrices' (decay vectors such as A_log stay
    fp32 in a bf16 model, so the first parameter is not it): its first linear projection's."""
    return next(m.weight.dtype for m in mixer.modules() if isinstance(m, torch.nn.Linear))


def apply_body(model, state: ModelState, entry: SegmentEntry, start: int, additive: bool = False) -> ModelState:
    """Apply a segment's cached body after its seam; `start` is the segment's real first position.

    additive=True is the ablation: states added without T and without the conv warm-up patch."""
    layers = list(state.layers)
    for i, body in enumerate(entry.layers):
        mixer = model.layers[i].mixer if body is not None else None
        if isinstance(body, LinearBody):
            cur = layers[i] if layers[i] is not None else None
            c = mixer.conv_kernel
            if cur is None:
                S_run = torch.zeros_like(body.S)
                conv_before = _zeros_conv(mixer, body, c)
            else:
                S_run, conv_before = cur.recurrent, cur.conv
            if additive:
                S0 = torch.zeros_like(body.S)
                S_w = run_warmup(mixer, body, S0, None if conv_before is None else torch.zeros_like(conv_before))
                S_new = S_run + compose(body.summary, S_w)
            else:
                S_w = run_warmup(mixer, body, S_run, conv_before)
                S_new = compose(body.summary, S_w)
            conv = conv_cat(conv_before, body.conv_tail, c - 1) if conv_before is not None else body.conv_tail
            layers[i] = LinearLayerState(conv, S_new)
        elif isinstance(body, AttentionBody):
            keys = mixer.rerotate(body.keys, start)
            cur = layers[i]
            if cur is None:
                layers[i] = AttentionLayerState(keys, body.values)
            else:
                layers[i] = AttentionLayerState(torch.cat([cur.keys, keys], 2), torch.cat([cur.values, body.values], 2))
    return ModelState(layers=layers, seq_len=state.seq_len + entry.body_len, extra=dict(state.extra))


def _zeros_conv(mixer, body: LinearBody, c: int):
    if c <= 1:
        return None
    ref = body.conv_tail if body.conv_tail is not None else None
    if ref is not None:
        return ref.new_zeros(1, ref.shape[1], c - 1)
    if body.warmup_inputs is not None:
        x = body.warmup_inputs[:, :1].to(mixer_dtype(mixer))
        C = mixer.conv_inputs(x).shape[-1]
        return x.new_zeros(1, C, c - 1)
    return None
