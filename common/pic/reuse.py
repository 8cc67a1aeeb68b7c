"""Reuse prefill: a prompt `seg_1 .. seg_n, query` from cached segment entries (docs/design.md §3).

Segment-major (`prefill_segment_major`), the order that can start before the last entry arrives:

    state := empty
    for each segment i:
        its seam tokens go through every layer from `state` at their real positions
        (full attention sees everything before; linear layers run from the running state);
        its cached body is applied: linear layer -> warm-up tokens re-run with the real conv
        state, then S := T_body . S + S_body, conv := body tail; attention layer -> body keys
        rotated to their real positions and appended.
    the query goes through every layer as a normal chunk.

Layer-major (`prefill_layer_major`), what a GPU wants: all seams of all segments pass through a
layer together; a linear layer computes every seam's (T, S|0) at once, runs the short scan of
compositions over segments, then all seam outputs from their incoming states; an attention layer
lays the seam keys out between the cached bodies and masks by real position. Both orders give
the same numbers (tests hold them to float round-off).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.layers.attention import attention_values, causal_attention
from common.models.base import ForwardContext
from common.pic.entry import AttentionBody, LinearBody, SegmentEntry, dtype_name
from common.pic.protocol import PicEngine
from common.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.compose import compose_summary as compose  # Triton on CUDA, torch on CPU (one chooser)
from kernels.linear_attn import (Summary, identity_transition, linear_attention, prefill_with_summary, segment_summary,
                                 summary_form)


def _conv_cat(tail: torch.Tensor, new: torch.Tensor | None, width: int) -> torch.Tensor:
    if new is None or new.shape[-1] == 0:
        return tail
    return torch.cat([tail.to(new.dtype), new], dim=-1)[..., -width:] if width > 0 else tail


# -- building an entry ---------------------------------------------------------------------------
@torch.inference_mode()
def build_entry(engine: PicEngine, token_ids, seam: int) -> SegmentEntry:
    """One forward pass that also builds the entry: each linear layer runs the fused kernel
    (kernels.linear_attn.prefill_with_summary) over its cached span, so T and S come out of the
    same pass as the outputs (`build_entry_reference`: a plain forward, then everything again)."""
    ids, seam = _check_build(engine, token_ids, seam)
    plan = BuildPlan(min(seam, len(ids)), engine.model)
    x = torch.tensor([ids], dtype=torch.long, device=engine.device)
    ctx = ForwardContext(positions=torch.arange(len(ids), device=engine.device), plan=plan)
    _, state = engine.model(x, engine.new_state(), ctx=ctx)
    w = plan.seam
    layers: list = []
    for i, layer in enumerate(engine.model.layers):
        if layer.kind == "linear":
            layers.append(plan.bodies[i])
        elif layer.kind == "attention":
            st = state.layers[i]
            layers.append(AttentionBody(st.keys[:, :, w:].clone(), st.values[:, :, w:].clone()))
        else:
            layers.append(None)
    return SegmentEntry(ids, seam, engine.fingerprint, dtype_name(engine.dtype), layers)


def _check_build(engine, token_ids, seam: int) -> tuple[list[int], int]:
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
                o_w, S_w = linear_attention(fam, q[:, head], k[:, head], v[:, head], g=_sl(g, head),
                                            beta=_sl(beta, head), scale=scale)
            span = slice(warm_end, L)
            o, S_end, summ = prefill_with_summary(fam, q[:, span], k[:, span], v[:, span], g=_sl(g, span),
                                                  beta=_sl(beta, span), scale=scale, initial_state=S_w)
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


@torch.inference_mode()
def build_entry_reference(engine, token_ids, seam: int) -> SegmentEntry:
    """The plain definition: a forward with the mixers' inputs captured, then every linear
    layer's features, summary and conv inputs computed again from them."""
    ids, seam = _check_build(engine, token_ids, seam)
    model = engine.model
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if layer.kind == "linear":
            hooks.append(layer.mixer.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[0])))
    try:
        _, _, state = engine.forward(ids, engine.new_state())
    finally:
        for h in hooks:
            h.remove()
    L, w = len(ids), min(seam, len(ids))
    layers: list = []
    for i, layer in enumerate(model.layers):
        if layer.kind == "linear":
            layers.append(_linear_body(layer.mixer, captured[i], L, w))
        elif layer.kind == "attention":
            st = state.layers[i]
            layers.append(AttentionBody(st.keys[:, :, w:].clone(), st.values[:, :, w:].clone()))
        else:
            layers.append(None)
    return SegmentEntry(ids, seam, engine.fingerprint, dtype_name(engine.dtype), layers)


def _linear_body(mixer, x: torch.Tensor, L: int, w: int) -> LinearBody:
    c = mixer.conv_kernel
    warm_end = min(L, max(w, c - 1))
    q, k, v, g, beta, _aux, _ = mixer.features(x, None)
    H, K = k.shape[2], k.shape[3]
    if warm_end < L:
        sl = slice(warm_end, L)
        summ = segment_summary(mixer.family, k[:, sl], v[:, sl], g=_sl(g, sl), beta=_sl(beta, sl))
        T, form, S = summ.T, summ.form, summ.S
    else:
        form = summary_form(mixer.family)
        T = identity_transition(form, 1, H, K, k.device)
        S = torch.zeros(1, H, K, v.shape[-1], device=k.device)
    u = mixer.conv_inputs(x)  # [1, L, C]
    conv_tail = u[:, max(w, L - (c - 1)) :].transpose(1, 2).contiguous() if L > w and c > 1 else None
    warm = x[:, w:warm_end].contiguous() if warm_end > w else None
    return LinearBody(T=T.contiguous(), form=form, S=S.contiguous(), conv_tail=conv_tail, warmup_inputs=warm)


def _sl(t, sl):
    return None if t is None else t[:, sl]



# -- applying a cached body ----------------------------------------------------------------------
def run_warmup(mixer, body: LinearBody, S: torch.Tensor, conv: torch.Tensor | None) -> torch.Tensor:
    """Advance S over the body's warm-up tokens with the real conv state (exact conv patch)."""
    if body.warmup_inputs is None:
        return S
    x = body.warmup_inputs.to(mixer_dtype(mixer))
    q, k, v, g, beta, _aux, _ = mixer.features(x, conv)
    _, S = linear_attention(mixer.family, q, k, v, g=g, beta=beta, initial_state=S, scale=mixer.scale)
    return S


def mixer_dtype(mixer) -> torch.dtype:
    return next(mixer.parameters()).dtype


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
            conv = _conv_cat(conv_before, body.conv_tail, c - 1) if conv_before is not None else body.conv_tail
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


# -- segment-major ---------------------------------------------------------------------------------
@torch.inference_mode()
def compose_segment(engine: PicEngine, state: ModelState, entry: SegmentEntry, additive: bool = False) -> ModelState:
    """Extend `state` (not mutated) by one segment from its entry: seam recomputed under the real
    prefix, then the cached body applied. What a combine worker calls as each entry arrives.
    additive=True: the ablation (no seam recompute, states added without T)."""
    start = state.seq_len
    if entry.seam_len and not additive:
        _, _, state = engine.forward(entry.seam_tokens, state)
    return apply_body(engine.model, state, entry, start, additive=additive)


def prefill_segment_major(engine: PicEngine, entries: list[SegmentEntry], state: ModelState | None = None,
                          additive: bool = False) -> ModelState:
    """State after every segment, composed from entries (seams recomputed unless additive)."""
    state = engine.new_state() if state is None else state
    for e in entries:
        state = compose_segment(engine, state, e, additive=additive)
    return state


# -- layer-major -------------------------------------------------------------------------------------
class SeamPlan:
    """All seams of all segments through the stack in one pass per layer (a
    common.models.base.LayerPlan: the model hands it every token mixer call)."""

    def __init__(self, model, entries: list[SegmentEntry], device):
        self.model = model
        self.entries = entries
        self.starts, pos, seam_pos, spans = [], 0, [], []
        for e in entries:
            self.starts.append(pos)
            spans.append((len(seam_pos), len(seam_pos) + e.seam_len))
            seam_pos.extend(range(pos, pos + e.seam_len))
            pos += e.n_tokens
        self.total = pos
        self.spans = spans
        self.seam_positions = torch.tensor(seam_pos, dtype=torch.long, device=device)

    # attention layers: seam keys between the cached bodies, masked by real position
    def attend(self, q, k, v, scale, ctx):
        mixer = self.model.layers[ctx.layer].mixer
        keys, values = [], []
        for e, (a, b), start in zip(self.entries, self.spans, self.starts):
            keys.append(k[:, :, a:b])
            values.append(v[:, :, a:b])
            body = e.layers[ctx.layer]
            if body is not None and body.keys.shape[2]:
                keys.append(mixer.rerotate(body.keys.to(k.dtype), start))
                values.append(body.values.to(v.dtype))
        K_all, V_all = torch.cat(keys, 2), torch.cat(values, 2)
        kpos = torch.arange(self.total, device=q.device)
        mask = kpos[None, :] <= self.seam_positions[:, None]
        B, Hq, Tq, D = q.shape
        n_rep = Hq // K_all.shape[1]
        V_use = attention_values(mixer, K_all, V_all)
        # query heads grouped by their kv head (head h reads kv head h // n_rep), the mask repeated
        # per group: no copy of every key and value per query head
        qg = q.reshape(B, K_all.shape[1], n_rep * Tq, D)
        o = F.scaled_dot_product_attention(qg, K_all, V_use, attn_mask=mask.repeat(n_rep, 1), scale=scale)
        return o.reshape(B, Hq, Tq, -1).transpose(1, 2), AttentionLayerState(K_all, V_all)

    # linear layers: batched seam summaries, a short scan, batched seam outputs
    def run_linear(self, mixer, x, ctx):
        i = ctx.layer
        c = mixer.conv_kernel
        bodies = [e.layers[i] for e in self.entries]
        u = mixer.conv_inputs(x)  # [1, Ws, C]
        C = u.shape[-1]
        run_conv = u.new_zeros(1, C, max(c - 1, 0))
        tails_in, conv_after_seam = [], []
        for (a, b), body in zip(self.spans, bodies):
            tails_in.append(run_conv)
            after = _conv_cat(run_conv, u[:, a:b].transpose(1, 2), c - 1)
            conv_after_seam.append(after)
            run_conv = _conv_cat(after, body.conv_tail, c - 1)
        n = len(self.entries)
        wmax = max(b - a for a, b in self.spans)
        X = x.new_zeros(n, wmax, x.shape[-1])
        valid = torch.zeros(n, wmax, dtype=torch.bool, device=x.device)
        for j, (a, b) in enumerate(self.spans):
            X[j, : b - a] = x[0, a:b]
            valid[j, : b - a] = True
        q, k, v, g, beta, aux, _ = mixer.features(X, torch.cat(tails_in, 0))
        pad = ~valid
        k = k.masked_fill(pad[:, :, None, None], 0)
        v = v.masked_fill(pad[:, :, None, None], 0)
        if g is not None:
            g = g.masked_fill(pad.view(n, wmax, *([1] * (g.dim() - 2))), 0)
        if beta is not None:
            beta = beta.masked_fill(pad[:, :, None], 0)
        seams = segment_summary(mixer.family, k, v, g=g, beta=beta)
        running = torch.zeros_like(bodies[0].S)
        incoming = []
        for j, body in enumerate(bodies):
            incoming.append(running)
            running = compose(Summary(seams.T[j : j + 1], seams.S[j : j + 1], seams.form), running)
            running = run_warmup(mixer, body, running, conv_after_seam[j])
            running = compose(body.summary, running)
        o, _ = linear_attention(mixer.family, q, k, v, g=g, beta=beta, initial_state=torch.cat(incoming, 0),
                                scale=mixer.scale)
        y = mixer.output(o, aux, x.dtype)  # [n, wmax, D]
        y = torch.cat([y[j : j + 1, : b - a] for j, (a, b) in enumerate(self.spans)], 1)
        return y, LinearLayerState(run_conv if c > 1 else None, running)


@torch.inference_mode()
def prefill_layer_major(engine: PicEngine, entries: list[SegmentEntry]) -> ModelState:
    if not any(e.seam_len for e in entries):
        return prefill_segment_major(engine, entries)
    model = engine.model
    plan = SeamPlan(model, entries, engine.device)
    ids = [t for e in entries for t in e.seam_tokens]
    ctx = ForwardContext(positions=plan.seam_positions, plan=plan)
    x = torch.tensor([ids], dtype=torch.long, device=engine.device)
    _, state = model(x, engine.new_state(), ctx=ctx, seq_len_after=plan.total)
    return state
