"""Building a segment's entry (docs/design.md §2): one forward pass of the segment alone that also
keeps, per linear layer, its cached body (T, S, conv tail, warm-up inputs), per attention layer its
keys and values after the seam. The plain definition it is tested against is
common.engine.pic.reference.build_entry_reference.
"""
from __future__ import annotations

from typing import Callable

import torch

from common.engine.layers.attention import attention_values, causal_attention
from common.engine.models.base import ForwardContext
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry, dtype_name
from common.engine.pic.protocol import PicEngine
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.linear_attn import identity_transition, linear_attention, prefill_with_summary, summary_form


class BuildCancelled(Exception):
    """A build stopped before layer `layer` of `layers` because its `should_stop` said so; nothing
    of it is kept."""

    def __init__(self, layer: int, layers: int, tokens: int):
        super().__init__(f"build of {tokens} tokens cancelled before layer {layer} of {layers}")
        self.layer, self.layers, self.tokens = layer, layers, tokens


def _stop_check(should_stop: Callable[[], bool], layers: int, tokens: int) -> Callable[[int], None]:
    def before_layer(i: int) -> None:
        if should_stop():
            raise BuildCancelled(i, layers, tokens)
    return before_layer


@torch.inference_mode()
def build_entry(engine: PicEngine, token_ids, seam: int,
                should_stop: Callable[[], bool] | None = None) -> SegmentEntry:
    """One forward pass that also builds the entry: each linear layer runs the fused kernel
    (kernels.linear_attn.prefill_with_summary) over its cached span, so T and S come out of the
    same pass as the outputs (`build_entry_reference`: a plain forward, then everything again).

    should_stop: asked before every layer (and once more before the entry is assembled); when it
    answers True the build raises BuildCancelled there (a scatter build nobody waits for any more)."""
    ids, seam = check_build(engine, token_ids, seam)
    plan = BuildPlan(min(seam, len(ids)), engine.model)
    x = torch.tensor([ids], dtype=torch.long, device=engine.device)
    n_layers = len(engine.model.layers)
    check = None if should_stop is None else _stop_check(should_stop, n_layers, len(ids))
    ctx = ForwardContext(positions=torch.arange(len(ids), device=engine.device), plan=plan, before_layer=check)
    _, state = engine.model(x, engine.new_state(), ctx=ctx)
    if check is not None:
        check(n_layers)
    return entry_from_state(engine, ids, seam, state, plan.bodies)


def check_build(engine, token_ids, seam: int) -> tuple[list[int], int]:
    ids = engine.check_tokens(token_ids)
    if not ids:
        raise ValueError("empty segment")
    if seam < 0:
        raise ValueError(f"seam width must be >= 0, got {seam}")
    return ids, seam


class BuildPlan:
    """The forward of a segment alone (empty start state) that keeps, per linear layer, the
    cached body: T and S(C|0) of the span after the conv warm-up, the conv tail, the warm-up
    tokens' inputs. Attention layers run as usual."""

    def __init__(self, seam: int, model):
        self.seam = seam
        self.model = model
        self.bodies: dict[int, LinearBody] = {}

    def attend(self, q, k, v, scale, ctx):
        values = attention_values(self.model.layers[ctx.layer].mixer, k, v)
        return causal_attention(q, k, values, scale), AttentionLayerState(k, v)

    def run_linear(self, mixer, x, ctx):
        L, w, c = x.shape[1], self.seam, mixer.conv_kernel
        warm_end = min(L, max(w, c - 1))
        q, k, v, g, beta, aux, tail = mixer.features(x, None)
        fam, scale = mixer.family, mixer.scale
        if warm_end < L:
            o_w, S_w = None, None
            if warm_end > 0:  # the warm-up tokens: a plain chunk, its end state enters the span
                head = slice(0, warm_end)
                o_w, S_w = linear_attention(fam, q[:, head], k[:, head], v[:, head], g=sliced(g, head),
                                            beta=sliced(beta, head), scale=scale)
            span = slice(warm_end, L)
            o, S_end, summ = prefill_with_summary(fam, q[:, span], k[:, span], v[:, span], g=sliced(g, span),
                                                  beta=sliced(beta, span), scale=scale, initial_state=S_w)
            o = o if o_w is None else torch.cat([o_w.to(o.dtype), o], 1)
            T, form, S = summ.T, summ.form, summ.S
        else:  # the whole body is warm-up: the span is empty
            o, S_end = linear_attention(fam, q, k, v, g=g, beta=beta, scale=scale)
            form = summary_form(fam)
            T = identity_transition(form, 1, k.shape[2], k.shape[3], k.device)
            S = torch.zeros(1, k.shape[2], k.shape[3], v.shape[-1], device=k.device)
        n_tail = min(L - w, c - 1)  # conv inputs of the body's last tokens (tail = last c-1 inputs)
        conv_tail = tail[..., tail.shape[-1] - n_tail :].contiguous() if n_tail > 0 and c > 1 else None
        warm = x[:, w:warm_end].contiguous() if warm_end > w else None
        self.bodies[ctx.layer] = LinearBody(T=T.contiguous(), form=form, S=S.contiguous(), conv_tail=conv_tail,
                                            warmup_inputs=warm)
        return mixer.output(o, aux, x.dtype), LinearLayerState(tail, S_end)


def entry_from_state(engine: PicEngine, ids: list[int], seam: int, state: ModelState,
                     linear_bodies: dict[int, LinearBody]) -> SegmentEntry:
    """The entry of segment `ids` from the state after its forward: each attention layer's keys and
    values after the seam, each linear layer's body from `linear_bodies` (by layer index)."""
    w = min(seam, len(ids))
    layers: list = []
    for i, layer in enumerate(engine.model.layers):
        if layer.kind == "linear":
            layers.append(linear_bodies[i])
        elif layer.kind == "attention":
            st = state.layers[i]
            layers.append(AttentionBody(st.keys[:, :, w:].clone(), st.values[:, :, w:].clone()))
        else:
            layers.append(None)
    return SegmentEntry(ids, seam, engine.fingerprint, dtype_name(engine.dtype), layers)


def sliced(t: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    """t[:, sl], for the features a family may not have (g, beta: None)."""
    return None if t is None else t[:, sl]
