"""`prefill_segments`: one prompt `seg_1 .. seg_n, query` prefilled in one of the four modes."""
from __future__ import annotations

import time
from typing import Sequence

from common.engine.modes import MODES, parse_mode, seam_for
from common.engine.pic.entry import (
    AttentionBody, EntryError, EntryMismatch, LinearBody, SegmentEntry, dtype_name, entry_layout, segment_key,
)
from common.engine.pic.prefix import PrefixCache, chain_keys, forward_segments_and_query
from common.engine.pic.protocol import PicEngine
from common.engine.pic.build import BuildCancelled, build_entry
from common.engine.pic.reuse import compose_run, compose_segment, prefill_layer_major, prefill_segment_major
from common.engine.state import ModelState, PrefillOutput



def validate(engine: PicEngine, segments, query, entries, mode: str, seam: int) -> tuple[str, list[list[int]], list[int]]:
    """(canonical mode, checked segments, checked query); ValueError / EntryMismatch on bad input."""
    mode = parse_mode(mode)
    if not isinstance(seam, int) or seam < 0:
        raise ValueError(f"seam width must be an int >= 0, got {seam!r}")
    if not segments:
        raise ValueError("no segments")
    segs = []
    for i, s in enumerate(segments):
        if len(s) == 0:
            raise ValueError(f"segment {i} is empty")
        segs.append(engine.check_tokens(s))
    if not query:
        raise ValueError("empty query: the next-token logits come from the query's last token")
    q = engine.check_tokens(query)
    if entries is not None:
        _check_entries(engine, entries, segs, seam_for(mode, seam))
    return mode, segs, q


def _check_entries(engine: PicEngine, entries, segs: list[list[int]], seam: int) -> None:
    if len(entries) != len(segs):
        raise ValueError(f"{len(entries)} entries for {len(segs)} segments")
    layout = entry_layout(engine.model)
    for i, (e, s) in enumerate(zip(entries, segs)):
        if e is None:
            continue
        if not isinstance(e, SegmentEntry):
            raise ValueError(f"entry {i} is a {type(e).__name__}, not a SegmentEntry")
        try:
            e.check(s, seam=seam, fingerprint=engine.fingerprint, dtype=engine.dtype, layout=layout)
        except EntryMismatch as err:
            raise EntryMismatch(f"entry {i}: {err}") from None


def prefill_segments(engine: PicEngine, segments: Sequence[Sequence[int]], query: Sequence[int],
                     entries: Sequence[SegmentEntry | None] | None = None, mode: str = "hypic", seam: int = 8,
                     order: str = "segment") -> PrefillOutput:
    """See HybridEngine.prefill_segments."""
    mode, segs, q = validate(engine, segments, query, entries, mode, seam)
    if order not in ("segment", "layer"):
        raise ValueError(f"order must be 'segment' or 'layer', got {order!r}")
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    extra: dict = {"mode": mode, "timings": timings}
    if mode == "full":
        out = engine.prefill([t for s in segs for t in s] + q)
    elif mode == "prefix":
        out = _prefix(engine, segs, q, extra)
    else:
        out = _query(engine, q, _reuse_state(engine, segs, entries, mode, seam_for(mode, seam), order, extra))
    timings["total_s"] = time.perf_counter() - t0
    out.extra.update(extra)
    return out


def _prefix(engine: PicEngine, segs: list[list[int]], q: list[int], extra: dict) -> PrefillOutput:
    """From the longest cached segment-aligned prefix, the uncached segments and the query in one
    pass (as full recompute runs the prompt), caching the state at every segment end."""
    keys = chain_keys(engine.fingerprint, dtype_name(engine.dtype), segs)
    state, reused = None, 0
    for j in range(len(segs) - 1, -1, -1):
        hit = engine.prefix_cache.get(keys[j])
        if hit is not None:
            state, reused = hit, j + 1
            break
    extra["reused_segments"] = reused
    if reused == len(segs):
        return _query(engine, q, state)
    states, logits, final = forward_segments_and_query(engine, segs[reused:], state, q)
    for j, st in enumerate(states, start=reused):
        engine.prefix_cache.put(keys[j], st)
    return PrefillOutput(logits=logits, state=final)


def _reuse_state(engine: PicEngine, segs: list[list[int]], entries, mode: str, seam: int, order: str,
                 extra: dict) -> ModelState:
    """State after `segs` composed from entries (built now where missing): hypic or additive."""
    timings = extra["timings"]
    t_build = time.perf_counter()
    built, full_entries = [], []
    for i, s in enumerate(segs):
        e = entries[i] if entries is not None else None
        if e is None:
            e = build_entry(engine, s, seam)
            built.append(i)
        full_entries.append(e)
    timings["build_s"] = time.perf_counter() - t_build
    t_comp = time.perf_counter()
    if mode == "additive":
        state = prefill_segment_major(engine, full_entries, additive=True)
    elif order == "layer":
        state = prefill_layer_major(engine, full_entries)
    else:
        state = prefill_segment_major(engine, full_entries)
    timings["compose_s"] = time.perf_counter() - t_comp
    extra["entries"] = full_entries
    extra["built"] = built
    return state


def _query(engine: PicEngine, q: list[int], state: ModelState) -> PrefillOutput:
    _, logits, state = engine.forward(q, state)
    return PrefillOutput(logits=logits[-1], state=state)
