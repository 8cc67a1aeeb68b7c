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

Layer-major (`prefill_layer_major`): all seams of all segments pass through a layer together
(one call per weight matrix for all of them); a linear layer computes every seam's features in
one batch, then scans the segments: each seam's short recurrence from the state composed so far,
its body's (T, S) applied after it; an attention layer lays the seam keys out between the cached
bodies and masks by real position. Both orders give the same numbers (tests hold them to float
round-off).

Runs (`compose_run`): the layer-major pass over a run of consecutive segments continuing from a
composed prefix state — what a combine worker does with the segments that arrived while it was
busy. `compose_run(engine, S, [e_i .. e_j])` equals `prefill_segment_major(engine, [e_i .. e_j], S)`.

The query folded in (`compose_and_query`): the pass that completes the prompt takes the query's
tokens along after the seams, so the weights are read once for both; its plain reference is
`query_after_compose` (compose_run, then the query as one chunk).
"""
from __future__ import annotations

from typing import Callable

import torch

from common.engine.layers.attention import (attention_values, causal_attention, flash_block, flash_blocks_available,
                                    merge_blocks)
from common.engine.models.base import ForwardContext
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry, dtype_name
from common.engine.pic.protocol import PicEngine
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.compose import compose_run_states
from kernels.compose import compose_summary as compose  # Triton on CUDA, torch on CPU (one chooser)
from kernels.linear_attn import (FAMILY_GATE, identity_transition, linear_attention, prefill_with_summary, segment_summary,
                                 summary_form)


def _conv_cat(tail: torch.Tensor, new: torch.Tensor | None, width: int) -> torch.Tensor:
    if new is None or new.shape[-1] == 0:
        return tail
    return torch.cat([tail.to(new.dtype), new], dim=-1)[..., -width:] if width > 0 else tail


# -- building an entry ---------------------------------------------------------------------------
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
    ids, seam = _check_build(engine, token_ids, seam)
    plan = BuildPlan(min(seam, len(ids)), engine.model)
    x = torch.tensor([ids], dtype=torch.long, device=engine.device)
    n_layers = len(engine.model.layers)
    check = None if should_stop is None else _stop_check(should_stop, n_layers, len(ids))
    ctx = ForwardContext(positions=torch.arange(len(ids), device=engine.device), plan=plan, before_layer=check)
    _, state = engine.model(x, engine.new_state(), ctx=ctx)
    if check is not None:
        check(n_layers)
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


def _rows(t, rows):
    return None if t is None else t[rows]



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
    common.engine.models.base.LayerPlan: the model hands it every token mixer call)."""

    def __init__(self, model, entries: list[SegmentEntry], device, prefix: ModelState | None = None,
                 capacity: int | None = None, query_len: int = 0):
        self.model = model
        self.entries = entries
        self.prefix = prefix  # the composed state the run continues from (None: the prompt's start)
        self.capacity = capacity  # the prompt's final length, when known: keys go into a KVArena
        self.arenas: dict[int, KVArena] = dict(prefix.extra.get(ARENAS, {})) if prefix is not None else {}
        p0 = 0 if prefix is None else prefix.seq_len
        self.starts, pos, seam_pos, spans = [], p0, [], []
        for e in entries:
            self.starts.append(pos)
            spans.append((len(seam_pos), len(seam_pos) + e.seam_len))
            seam_pos.extend(range(pos, pos + e.seam_len))
            pos += e.n_tokens
        self.total = pos  # the position after the run's last segment
        self.spans = spans
        self.seam_tokens = len(seam_pos)
        # The folded query (compose_and_query): its tokens follow the seams in the call, at
        # positions total .. total+query_len-1, after every segment of the run.
        self.query_len = query_len
        self.end = pos + query_len
        seam_pos.extend(range(pos, self.end))
        self.seam_positions = torch.tensor(seam_pos, dtype=torch.long, device=device)
        # Attention sees the query as one more span (a seam with no body), after the last segment.
        self.all_spans = spans + ([(self.seam_tokens, self.seam_tokens + query_len)] if query_len else [])
        self.all_starts = self.starts + ([pos] if query_len else [])

    # attention layers: seam keys between the cached bodies, masked by real position
    def _prefix_layer(self, i: int):
        return None if self.prefix is None else self.prefix.layers[i]

    def attend(self, q, k, v, scale, ctx):
        mixer = self.model.layers[ctx.layer].mixer
        keys, values = [], []
        before = self._prefix_layer(ctx.layer)
        if before is not None:  # the prefix's keys, already at their real positions 0 .. p0-1
            keys.append(before.keys.to(k.dtype))
            values.append(before.values.to(v.dtype))
        for e, (a, b), start in zip(self.entries, self.spans, self.starts):
            keys.append(k[:, :, a:b])
            values.append(v[:, :, a:b])
            body = e.layers[ctx.layer]
            if body is not None and body.keys.shape[2]:
                keys.append(mixer.rerotate(body.keys.to(k.dtype), start))
                values.append(body.values.to(v.dtype))
        if self.query_len:
            keys.append(k[:, :, self.seam_tokens:])
            values.append(v[:, :, self.seam_tokens:])
        p0 = 0 if before is None else before.keys.shape[2]
        K_all, V_all = self._lay_out(ctx.layer, before, keys, values)
        V_use = attention_values(mixer, K_all, V_all)
        if flash_blocks_available(q, V_use):
            o = self._attend_merged(q, K_all, V_use, p0, scale)
        else:
            o = self._attend_per_seam(q, K_all, V_use, scale)
        return o, AttentionLayerState(K_all, V_all)

    def _lay_out(self, layer: int, before, keys: list, values: list):
        """This layer's keys and values after the run: written after the prefix's in the
        prompt's arena when the prefix is the arena's latest state (no copy of the prefix),
        else concatenated."""
        if self.capacity is not None and self.capacity >= self.end:
            arena = self.arenas.get(layer)
            if arena is None or not arena.continues(before, self.capacity):
                skip = 1 if before is not None else 0  # the prefix goes in as one piece
                arena = KVArena(before, keys[skip:], values[skip:], self.capacity)
                self.arenas[layer] = arena
                return arena.extend(keys[skip:], values[skip:])
            return arena.extend(keys[1:], values[1:])
        return torch.cat(keys, 2), torch.cat(values, 2)

    def _attend_per_seam(self, q, K_all, V_use, scale):
        """The plain form: each seam attends to every key before it and causally to itself, one
        causal attention with an offset per seam (no [seams, keys] mask, which SDPA would turn
        into a float mask and compute in full). [B, Ws, Hq, Dv]"""
        outs = []
        for (a, b), start in zip(self.all_spans, self.all_starts):
            if b > a:
                end = start + (b - a)
                outs.append(causal_attention(q[:, :, a:b], K_all[:, :, :end], V_use[:, :, :end], scale))
        return torch.cat(outs, 1)

    def _attend_merged(self, q, K_all, V_use, p0: int, scale):
        """The same attention in blocks of keys merged by log-sum-exp (CPU flash kernel), each
        block read once: the composed prefix's keys by every seam of the run in one call; each
        segment of the run (its seam and body keys) by the seams after it in one call; each
        seam's own keys causally. [B, Ws, Hq, Dv]"""
        B, Hq, Ws, _ = q.shape
        acc_o = q.new_zeros(B, Hq, Ws, V_use.shape[-1], dtype=torch.float32)
        acc_lse = q.new_full((B, Hq, Ws), float("-inf"), dtype=torch.float32)

        def add(rows: slice, k0: int, k1: int, causal: bool):  # rows of q over keys k0 .. k1-1
            o, lse = flash_block(q[:, :, rows], K_all[:, :, k0:k1], V_use[:, :, k0:k1], scale, causal)
            acc_o[:, :, rows], acc_lse[:, :, rows] = merge_blocks(acc_o[:, :, rows], acc_lse[:, :, rows], o, lse)

        if p0 > 0:
            add(slice(0, Ws), 0, p0, causal=False)
        starts = self.all_starts
        for j, ((a, b), start) in enumerate(zip(self.all_spans, starts)):
            end = starts[j + 1] if j + 1 < len(starts) else self.end
            if b < Ws and end > start:  # this segment's keys, for every later seam
                add(slice(b, Ws), start, end, causal=False)
            if b > a:  # its own seam, causally
                add(slice(a, b), start, start + b - a, causal=True)
        return acc_o.to(q.dtype).transpose(1, 2)

    # linear layers: batched seam summaries, a short scan, batched seam outputs
    def run_linear(self, mixer, x, ctx):
        i = ctx.layer
        c = mixer.conv_kernel
        bodies = [e.layers[i] for e in self.entries]
        ws = self.seam_tokens
        before = self._prefix_layer(i)
        conv_in = before.conv if before is not None else None
        tails_in, conv_after_seam, run_conv = self._conv_tails(mixer, x[:, :ws], conv_in, bodies)
        n = len(self.entries)
        wmax = max(b - a for a, b in self.spans)
        X = x.new_zeros(n, wmax, x.shape[-1])
        for j, (a, b) in enumerate(self.spans):
            X[j, : b - a] = x[0, a:b]
        # features of every seam in one batch (rows padded at the end: the padding is causal-after
        # and its outputs are dropped); then each seam's recurrence from the state composed so far,
        # its body applied after it (a scan over the run's segments)
        q, k, v, g, beta, aux, _ = mixer.features(X, torch.cat(tails_in, 0))
        running = before.recurrent if before is not None else torch.zeros_like(bodies[0].S)
        feats = (q, k, v, g, beta)
        if run_composable(mixer.family, bodies):
            o, running = self._scan_run(mixer, feats, bodies, running)
        else:
            o, running = self._scan_one_by_one(mixer, feats, bodies, running, conv_after_seam)
        y = mixer.output(o, aux, x.dtype)  # [n, wmax, D]
        y = torch.cat([y[j : j + 1, : b - a] for j, (a, b) in enumerate(self.spans)], 1)
        # (a copy: the last body's tail is a view of its entry's received buffer, which the
        # state would otherwise keep alive through the whole decode)
        after = LinearLayerState(run_conv.clone() if c > 1 else None, running)
        if self.query_len:  # the folded query: the mixer's own forward from the composed state
            y_q, after = mixer(x[:, ws:], after, ctx)
            y = torch.cat([y, y_q.to(y.dtype)], 1)
        return y, after

    def _scan_one_by_one(self, mixer, feats, bodies, running, conv_after_seam):
        """Each seam's recurrence from the state composed so far, its body (warm-up tokens, then
        (T, S)) applied after it, segment by segment: the reference of `_scan_run`, and the path
        for runs it does not cover. Returns (seam outputs [n, wmax, ...], state after the run)."""
        q, k, v, g, beta = feats
        o = None
        for j, ((a, b), body) in enumerate(zip(self.spans, bodies)):
            if b > a:
                rows = (slice(j, j + 1), slice(0, b - a))
                o_j, running = linear_attention(mixer.family, q[rows], k[rows], v[rows], g=_rows(g, rows),
                                                beta=_rows(beta, rows), initial_state=running, scale=mixer.scale)
                if o is None:
                    o = o_j.new_zeros(q.shape[0], q.shape[1], *o_j.shape[2:])
                o[rows] = o_j
            running = run_warmup(mixer, body, running, conv_after_seam[j])
            running = compose(body.summary, running)
        return o, running

    def _scan_run(self, mixer, feats, bodies, running):
        """The same scan in three calls per layer whatever the run's length: every seam's summary
        from zero (one batched call; the padding rows made identity steps: k, v, beta and the
        log-decay zero), the run's 2n summaries composed in one launch (kernels.compose
        .compose_run_states: the state entering each seam and after the run), every seam's
        outputs from its entering state (one batched call)."""
        q, k, v, g, beta = (_padding_zeroed(t, self.spans) for t in feats)
        seams = segment_summary(mixer.family, k, v, g=g, beta=beta)
        Tb = torch.cat([b.T for b in bodies], 0)
        Sb = torch.cat([b.S for b in bodies], 0)
        entering, after = compose_run_states(seams.T, seams.S, Tb, Sb, running[0], form=seams.form)
        o, _ = linear_attention(mixer.family, q, k, v, g=g, beta=beta, initial_state=entering, scale=mixer.scale)
        return o, after.unsqueeze(0)

    def _conv_tails(self, mixer, xs, conv_in, bodies):
        """(conv state entering each seam, conv state after each seam (None where not needed),
        conv state after the run). These need the seams' own conv inputs only where a body is too short to
        hold a full conv tail or has warm-up tokens; otherwise each body's cached tail is the
        state entering the next seam and the seams' inputs are not projected a second time."""
        c = mixer.conv_kernel
        if c <= 1 or any(b.warmup_inputs is not None or b.conv_tail is None or b.conv_tail.shape[-1] < c - 1
                         for b in bodies):
            u = mixer.conv_inputs(xs)  # [1, Ws, C] (no conv, c <= 1: [1, Ws, 0], free)
            zeros = u.new_zeros(1, u.shape[-1], max(c - 1, 0))
        else:
            u = None
            zeros = bodies[0].conv_tail.new_zeros(1, bodies[0].conv_tail.shape[1], c - 1).to(xs.dtype)
        run_conv = _full_conv(conv_in, zeros)
        tails_in, after_seam = [], []
        for (a, b), body in zip(self.spans, bodies):
            tails_in.append(run_conv)
            after = _conv_cat(run_conv, u[:, a:b].transpose(1, 2), c - 1) if u is not None else None
            after_seam.append(after)
            run_conv = _conv_cat(after, body.conv_tail, c - 1) if u is not None else body.conv_tail
        return tails_in, after_seam, run_conv


def run_composable(family: str, bodies) -> bool:
    """Whether SeamPlan._scan_run covers a linear layer's run: no body re-runs warm-up tokens (their
    conv patch is not a summary), and padding rows can be made identity steps (a per-head
    constant decay, gate "head", would decay them)."""
    return FAMILY_GATE[family] != "head" and all(b.warmup_inputs is None for b in bodies)


def _padding_zeroed(t: torch.Tensor | None, spans) -> torch.Tensor | None:
    """A copy of per-token features [n, wmax, ...] with every row past its seam's length zeroed."""
    if t is None or t.dim() < 2:
        return t
    out = t.clone()
    for j, (a, b) in enumerate(spans):
        out[j, b - a :] = 0
    return out


ARENAS = "kv_arenas"  # ModelState.extra: per attention layer, the KVArena its keys live in


class KVArena:
    """One attention layer's keys and values of a prompt being composed run by run, allocated
    once at the prompt's final length: each run writes its keys after the prefix's, where a
    concatenation would copy the whole prefix again for every run. A state's keys are a view of
    the first `length` positions. Only the arena's latest state may be extended in place (like
    appending to a shared slice): continuing from an older state again gets a fresh arena, so a
    state a caller kept is never overwritten."""

    def __init__(self, before, keys: list, values: list, capacity: int):
        ref_k = before.keys if before is not None else keys[0]
        ref_v = before.values if before is not None else values[0]
        B, H, _, Dk = ref_k.shape
        self.keys = ref_k.new_empty(B, H, capacity, Dk)
        self.values = ref_v.new_empty(B, ref_v.shape[1], capacity, ref_v.shape[-1])
        self.length = 0
        if before is not None:
            self.extend([before.keys], [before.values])

    def continues(self, before, capacity: int) -> bool:
        """Whether `before` is this arena's latest state (and the arena is large enough)."""
        return (before is not None and self.keys.shape[2] >= capacity and self.length == before.keys.shape[2]
                and before.keys.data_ptr() == self.keys.data_ptr() and before.keys.dtype == self.keys.dtype)

    def extend(self, keys: list, values: list):
        """Write these pieces after the current end; (keys, values) views up to the new end."""
        for k, v in zip(keys, values):
            n = k.shape[2]
            self.keys[:, :, self.length:self.length + n] = k
            self.values[:, :, self.length:self.length + n] = v
            self.length += n
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


def without_arenas(state: ModelState) -> ModelState:
    """The state once composition is over: its keys stay views of the arenas, but the state no
    longer carries them along (a query or decode step concatenates new keys; the arena buffers
    are then freed with the last view instead of living on in every later state's extra)."""
    if ARENAS not in state.extra:
        return state
    extra = {k: v for k, v in state.extra.items() if k != ARENAS}
    return ModelState(layers=state.layers, seq_len=state.seq_len, extra=extra)


def _full_conv(conv: torch.Tensor | None, zeros: torch.Tensor) -> torch.Tensor:
    """A conv tail of the full kernel-1 width: a shorter one (a prompt that began fewer than
    kernel-1 tokens ago) is left-padded with the zeros every prompt starts from."""
    if conv is None:
        return zeros
    short = zeros.shape[-1] - conv.shape[-1]
    return torch.cat([zeros[..., :short], conv.to(zeros.dtype)], -1) if short > 0 else conv.to(zeros.dtype)


@torch.inference_mode()
def prefill_layer_major(engine: PicEngine, entries: list[SegmentEntry]) -> ModelState:
    """State after every segment, all seams through each layer together, from the empty state."""
    return compose_run(engine, engine.new_state(), entries)


@torch.inference_mode()
def compose_run(engine: PicEngine, state: ModelState, entries: list[SegmentEntry],
                capacity: int | None = None) -> ModelState:
    """Extend `state` (not mutated) by a run of consecutive segments in one layer-major pass:
    the same numbers as composing them one by one (`prefill_segment_major(engine, entries, state)`,
    the reference), with one forward call for all their seams instead of one per segment.
    capacity: the prompt's final length when the caller knows it (a combine worker does): the
    attention keys then live in one KVArena per layer, extended in place run after run."""
    if not entries:
        return state
    if not any(e.seam_len for e in entries):
        return prefill_segment_major(engine, entries, state)
    _, out = _layer_major_pass(engine, state, entries, capacity, [])
    return out


@torch.inference_mode()
def compose_and_query(engine: PicEngine, state: ModelState, entries: list[SegmentEntry], query: list[int],
                      capacity: int | None = None) -> tuple[torch.Tensor, ModelState]:
    """The last run of a prompt and its query in one layer-major pass: at every layer the query
    tokens go through in the same call as the run's seams (one pass over the weights instead of
    two), from the state the run composes. Returns (the query's last logits [vocab], the state
    after the query): the same numbers, to float round-off, as the plain two-step
    `query_after_compose` (compose_run, then engine.forward(query)). capacity: as compose_run,
    counting the query's tokens."""
    if not query:
        raise ValueError("empty query")
    if not entries or not any(e.seam_len for e in entries):
        return query_after_compose(engine, state, entries, query, capacity)
    hidden, out = _layer_major_pass(engine, state, entries, capacity, engine.check_tokens(query))
    return engine.model.logits(hidden[0, -1:])[-1], out


def query_after_compose(engine: PicEngine, state: ModelState, entries: list[SegmentEntry], query: list[int],
                        capacity: int | None = None) -> tuple[torch.Tensor, ModelState]:
    """The plain reference of compose_and_query: compose the run, then the query as one chunk."""
    state = without_arenas(compose_run(engine, state, entries, capacity=capacity))
    _, logits, state = engine.forward(query, state)
    return logits[-1], state


def _layer_major_pass(engine: PicEngine, state: ModelState, entries: list[SegmentEntry], capacity: int | None,
                      query: list[int]) -> tuple[torch.Tensor, ModelState]:
    """(final hidden [1, seams + query, D], state after the run and the query)."""
    model = engine.model
    plan = SeamPlan(model, entries, engine.device, prefix=state, capacity=capacity, query_len=len(query))
    ids = [t for e in entries for t in e.seam_tokens] + list(query)
    ctx = ForwardContext(positions=plan.seam_positions, plan=plan)
    x = torch.tensor([ids], dtype=torch.long, device=engine.device)
    hidden, out = model(x, state, ctx=ctx, seq_len_after=plan.end)
    if plan.arenas:
        out.extra[ARENAS] = plan.arenas
    return hidden, out
