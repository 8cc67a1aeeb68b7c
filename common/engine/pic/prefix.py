"""The Prefix Cache baseline: exact reuse of the longest segment-aligned prefix seen before.

Model states are kept at segment boundaries (as SGLang's and vLLM's hybrid prefix caches keep
them), keyed by a chained hash of the segments so far, bounded in bytes, evicted LRU.

The uncached segments and the query run in one forward pass (`forward_segments_and_query`), as
full recompute runs the whole prompt, which a fair baseline must match:
attention layers attend over the whole suffix in one call and the boundary states hold views of
its keys and values (no per-segment copies); linear layers run one chunked recurrence over it and
read their state at each boundary from its chunk states (kernels.linear_attn.segments).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import torch

from common.engine.layers.attention import append_kv, attention_values, causal_attention
from common.engine.models.base import ForwardContext
from common.engine.state import AttentionLayerState, LinearLayerState, ModelState
from kernels.linear_attn import segment_states


def chain_keys(fingerprint: str, dtype: str, segments: list[list[int]]) -> list[str]:
    """keys[j] identifies the prefix segments[0..j] (boundaries included)."""
    keys, h = [], hashlib.blake2b(digest_size=20, person=b"hypic-prefix-v1")
    h.update(fingerprint.encode() + b"\0" + dtype.encode())
    for seg in segments:
        h.update(struct.pack(f"<I{len(seg)}I", len(seg), *seg))
        keys.append(h.copy().hexdigest())
    return keys


class PrefixCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[ModelState, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> ModelState | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, state: ModelState) -> None:
        if key in self._items:
            self._items.move_to_end(key)
            return
        size = state.nbytes()
        if size > self.max_bytes:
            return
        self._items[key] = (state, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, s) = self._items.popitem(last=False)
            self.bytes -= s

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


@torch.inference_mode()
def forward_segments(engine, segments: list[list[int]], state: ModelState | None) -> list[ModelState]:
    """Run `segments` after `state` (None: from the start) in one forward pass; the model state
    at the end of each segment. Equals one engine.forward per segment (up to float round-off)."""
    return forward_segments_and_query(engine, segments, state, None)[0]


@torch.inference_mode()
def forward_segments_and_query(engine, segments: list[list[int]], state: ModelState | None,
                               query: list[int] | None) -> tuple[list[ModelState], torch.Tensor | None, ModelState]:
    """`segments` then `query` (None: none) after `state` in one forward pass, as full recompute
    runs a prompt: (the state at the end of each segment, the logits at the query's last token or
    None, the state after everything)."""
    state = engine.new_state() if state is None else state
    ids = [t for seg in segments for t in seg] + list(query or [])
    ends, n = [], 0
    for seg in segments:
        n += len(seg)
        ends.append(n)
    if query:
        ends.append(len(ids))  # the pass's last piece; no state is kept for it
    plan = SegmentEndsPlan(state, ends, engine.model)
    start = state.seq_len
    ctx = ForwardContext(positions=torch.arange(start, start + len(ids), device=engine.device), plan=plan)
    hidden, final = engine.model(torch.tensor([ids], dtype=torch.long, device=engine.device), state, ctx=ctx)
    out = []
    for j, end in enumerate(ends[:len(segments)]):
        layers = [plan.at_end[j].get(i, final.layers[i]) for i in range(len(final.layers))]
        out.append(ModelState(layers=layers, seq_len=start + end, extra=dict(state.extra)))
    logits = engine.model.logits(hidden[0, -1:])[-1] if query else None
    return out, logits, final


class SegmentEndsPlan:
    """Forward-context plan of `forward_segments`: records every layer's state at each segment
    end (the last end's state is the pass's own result)."""

    def __init__(self, state: ModelState, ends: list[int], model):
        self.state = state
        self.model = model
        self.ends = ends
        self.at_end: list[dict[int, object]] = [{} for _ in ends]

    def attend(self, q, k, v, scale, ctx):
        st = append_kv(self.state.layers[ctx.layer], k, v)
        past = st.keys.shape[2] - k.shape[2]
        for j, end in enumerate(self.ends[:-1]):
            self.at_end[j][ctx.layer] = AttentionLayerState(st.keys[:, :, : past + end], st.values[:, :, : past + end])
        values = attention_values(self.model.layers[ctx.layer].mixer, st.keys, st.values)
        return causal_attention(q, st.keys, values, scale), st

    def run_linear(self, mixer, x, ctx):
        """The layer over the whole pass once (features, one chunked recurrence, output), with its
        state at every segment end: the recurrence's from `segment_states`, the conv tail from
        the k - 1 inputs before the end (they are all the conv keeps)."""
        prev = self.state.layers[ctx.layer]
        conv, S0 = (None, None) if prev is None else (prev.conv, prev.recurrent)
        q, k, v, g, beta, aux, tail = mixer.features(x, conv)
        o, states = segment_states(mixer.family, q, k, v, g=g, beta=beta, initial_state=S0, scale=mixer.scale,
                                   ends=self.ends)
        tails = _conv_tails(mixer, x, conv, tail, self.ends[:-1])
        for j, tail_j in enumerate(tails):
            self.at_end[j][ctx.layer] = LinearLayerState(tail_j, states[j])
        return mixer.output(o, aux, x.dtype), LinearLayerState(tail, states[-1])


def _conv_tails(mixer, x, conv, tail, ends: list[int]) -> list:
    """The short conv's tail after the first `end` tokens of x, for every end: the conv inputs of
    the last k - 1 of them (one projection of all those rows), preceded by the incoming tail `conv`
    where there are fewer (None: zeros)."""
    if tail is None:  # a mixer without a short conv
        return [None] * len(ends)
    if not ends:
        return []
    width = tail.shape[-1]
    at = [e - width + i for e in ends for i in range(width)]
    rows = mixer.conv_inputs(x[:, [max(p, 0) for p in at]]).transpose(1, 2).to(tail.dtype)  # [B, C, n*width]
    early = [i for i, p in enumerate(at) if p < 0]
    if early:  # an end within the first k - 1 tokens: the incoming tail's last inputs come first
        before = conv.to(tail.dtype) if conv is not None else tail.new_zeros(tail.shape)
        rows[..., early] = before[..., [width + at[i] for i in early]]
    return [rows[..., j * width:(j + 1) * width] for j in range(len(ends))]
