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

The parts live beside this module: building an entry in common.engine.pic.build, applying a cached
body in common.engine.pic.apply, the layer-major plan in common.engine.pic.seam_plan, the plain
build reference in common.engine.pic.reference.
"""
from __future__ import annotations

import torch

from common.engine.models.base import ForwardContext
from common.engine.pic.apply import apply_body
from common.engine.pic.entry import SegmentEntry
from common.engine.pic.protocol import PicEngine
from common.engine.pic.seam_plan import ARENAS, SeamPlan, without_arenas
from common.engine.state import ModelState

__all__ = ["compose_and_query", "compose_run", "compose_segment", "prefill_layer_major", "prefill_segment_major",
           "query_after_compose", "without_arenas"]


# -- segment-major ---------------------------------------------------------------------------------
@torch.inference_mode()
def compose_segment(engine: PicEngine, state: ModelState, entry: SegmentEntry, additive: bool = False,
                    without_t: bool = False) -> ModelState:
    """Extend `state` (not mutated) by one segment from its entry: seam recomputed under the real
    prefix, then the cached body applied. What a combine worker calls as each entry arrives.
    additive=True: the ablation (no seam recompute, states added without T). without_t=True: the
    seam recomputed, the body applied as the ablation applies it (a fault drills inject)."""
    start = state.seq_len
    if entry.seam_len and not additive:
        _, _, state = engine.forward(entry.seam_tokens, state)
    return apply_body(engine.model, state, entry, start, additive=additive or without_t)


def prefill_segment_major(engine: PicEngine, entries: list[SegmentEntry], state: ModelState | None = None,
                          additive: bool = False) -> ModelState:
    """State after every segment, composed from entries (seams recomputed unless additive)."""
    state = engine.new_state() if state is None else state
    for e in entries:
        state = compose_segment(engine, state, e, additive=additive)
    return state


# -- layer-major -------------------------------------------------------------------------------------
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
