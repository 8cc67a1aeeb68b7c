"""The layer-major pass (docs/design.md §3): all seams of a run of segments through each layer
together. SeamPlan is the common.engine.models.base.LayerPlan the model hands every token mixer call:
an attention layer lays the seam keys out between the cached bodies (in a KVArena when the prompt's
length is known) and masks by real position; a linear layer computes every seam's features in one
batch, then scans the segments (each seam's short recurrence, then its body applied).
"""
from __future__ import annotations

import torch

from common.engine.layers.attention import (attention_values, causal_attention, flash_block, flash_blocks_available,
                                            merge_blocks)
from common.engine.pic.apply import conv_cat, run_warmup
from common.engine.pic.entry import SegmentEntry
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.compose import compose_run_states
from kernels.compose import compose_summary as compose  # Triton on CUDA, torch on CPU (one chooser)
from kernels.linear_attn import linear_attention, segment_summary
from kernels.linear_attn.lowrank import stack_transitions


def _rows(t, rows):
    return None if t is None else t[rows]


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
        if run_composable(bodies):
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
        outputs from its entering state (one batched call). A log-decay fixed per head (g [H]) is
        given per token ([n, wmax, H], the same on every row; the kernels take both) so that the
        padding rows' gates can be zero."""
        q, k, v, g, beta = feats
        if g is not None and g.dim() == 1:
            g = g.view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
        q, k, v, g, beta = (_padding_zeroed(t, self.spans) for t in (q, k, v, g, beta))
        seams = segment_summary(mixer.family, k, v, g=g, beta=beta)
        Tb = stack_transitions([b.T for b in bodies])  # dense, or factors padded to one rank
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
            after = conv_cat(run_conv, u[:, a:b].transpose(1, 2), c - 1) if u is not None else None
            after_seam.append(after)
            run_conv = conv_cat(after, body.conv_tail, c - 1) if u is not None else body.conv_tail
        return tails_in, after_seam, run_conv


def run_composable(bodies) -> bool:
    """Whether SeamPlan._scan_run covers a linear layer's run: no body re-runs warm-up tokens (their
    conv patch is not a summary). Every family is covered (a per-head decay is given per token there,
    so that padding rows are identity steps), and so are bodies whose T is held as factors
    (kernels.linear_attn.lowrank.LowRankT, stacked for the one launch by
    kernels.linear_attn.lowrank.stack_transitions)."""
    return all(b.warmup_inputs is None for b in bodies)


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
