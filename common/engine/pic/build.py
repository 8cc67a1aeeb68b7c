"""Building a segment's entry (docs/design.md §2): one forward pass of the segment alone that also
keeps, per linear layer, its cached body (T, S, conv tail, warm-up inputs), per attention layer its
keys and values after the seam. The plain definition it is tested against is
common.engine.pic.reference.build_entry_reference.

A delta-family layer (matrix T) whose cached span is short enough keeps T as its low-rank factors
(kernels.linear_attn.lowrank.transition_factors, T = diag(gamma) - P^T Q of rank <= the span's
length) instead of the K x K matrix: automatically when they take fewer bytes in the engine's entry
format (common.engine.pic.compact.lowrank_is_smaller: for K = 128, spans of at most 63 tokens in fp32), and then
the dense T is never computed. `lowrank` "always"/"never" forces the choice (tests, measurements).
"""
from __future__ import annotations

from typing import Callable

import torch

from common.engine.layers.attention import attention_values, causal_attention
from common.engine.models.base import ForwardContext
from common.engine.pic.compact import DEFAULT_ENTRY_FORMAT, lowrank_is_smaller
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry, dtype_name
from common.engine.pic.protocol import PicEngine
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.linear_attn import FAMILY, identity_transition, linear_attention, prefill_with_summary, summary_form
from kernels.linear_attn.lowrank import transition_factors

LOWRANK_MODES = ("auto", "always", "never")


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
                should_stop: Callable[[], bool] | None = None, lowrank: str = "auto") -> SegmentEntry:
    """One forward pass that also builds the entry: each linear layer runs the fused kernel
    (kernels.linear_attn.prefill_with_summary) over its cached span, so T and S come out of the
    same pass as the outputs (`build_entry_reference`: a plain forward, then everything again).

    should_stop: asked before every layer (and once more before the entry is assembled); when it
    answers True the build raises BuildCancelled there (a scatter build nobody waits for any more).
    lowrank: "auto" (factors where smaller in the engine's entry format), "always" or "never"."""
    ids, seam = check_build(engine, token_ids, seam)
    fmt = getattr(engine, "entry_format", DEFAULT_ENTRY_FORMAT)
    plan = BuildPlan(min(seam, len(ids)), engine.model, lowrank, fmt)
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

    def __init__(self, seam: int, model, lowrank: str = "auto", entry_format: str = DEFAULT_ENTRY_FORMAT):
        if lowrank not in LOWRANK_MODES:
            raise ValueError(f"lowrank must be one of {LOWRANK_MODES}, got {lowrank!r}")
        self.seam = seam
        self.model = model
        self.lowrank, self.entry_format = lowrank, entry_format
        self.bodies: dict[int, LinearBody] = {}

    def keeps_lowrank(self, family: str, L: int, K: int) -> bool:
        """Whether a span of L tokens of `family` keeps T as low-rank factors."""
        if not FAMILY[family].delta or self.lowrank == "never":
            return False
        return self.lowrank == "always" or lowrank_is_smaller(L, K, self.entry_format)

    def span_summary(self, fam, q, k, v, g, beta, scale, S_w):
        """(o, end state, T, form, S(C|0)) of the cached span from the state S_w the warm-up left
        (None: zero). Low-rank: the plain chunked forward and the factors, S(C|0) recovered as
        end - T S_w as prefill_with_summary does; otherwise the fused kernel's dense T."""
        if self.keeps_lowrank(fam, k.shape[1], k.shape[3]):
            o, S_end = linear_attention(fam, q, k, v, g=g, beta=beta, scale=scale, initial_state=S_w)
            T = transition_factors(k, beta, g)
            S0 = S_end if S_w is None else S_end - T.apply(S_w.float())
            return o, S_end, T, "matrix", S0
        o, S_end, summ = prefill_with_summary(fam, q, k, v, g=g, beta=beta, scale=scale, initial_state=S_w)
        return o, S_end, summ.T, summ.form, summ.S

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
            o, S_end, T, form, S = self.span_summary(fam, q[:, span], k[:, span], v[:, span], sliced(g, span),
                                                     sliced(beta, span), scale, S_w)
            o = o if o_w is None else torch.cat([o_w.to(o.dtype), o], 1)
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
