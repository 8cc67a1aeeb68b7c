"""Position-independent caching of prompt segments (DESIGN §1, §2, §5).

`prefill_segments` runs one prompt `seg_1 .. seg_n, query` in one of four modes:
full (recompute everything), prefix (exact reuse of a cached segment-aligned prefix),
naive (entries concatenated by state addition: no T, no seams) and hypic.
"""
from __future__ import annotations

import time

import torch

from common.pic.entry import AttentionBody, EntryError, LinearBody, SegmentEntry, dtype_name, segment_key
from common.pic.prefix import PrefixCache, chain_keys, forward_segments
from common.pic.reuse import build_entry, compose_segment, prefill_layer_major, prefill_segment_major

MODES = ("full", "prefix", "naive", "hypic")

__all__ = [
    "MODES", "AttentionBody", "EntryError", "LinearBody", "PrefixCache", "SegmentEntry", "build_entry",
    "compose_segment", "prefill_layer_major", "prefill_segment_major",
    "prefill_segments", "segment_key",
]


def validate(engine, segments, query, entries, mode: str, seam: int):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
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
        if len(entries) != len(segs):
            raise ValueError(f"{len(entries)} entries for {len(segs)} segments")
        want_seam = 0 if mode == "naive" else seam
        for i, (e, s) in enumerate(zip(entries, segs)):
            if e is None:
                continue
            if not isinstance(e, SegmentEntry):
                raise ValueError(f"entry {i} is a {type(e).__name__}, not a SegmentEntry")
            if e.model_fingerprint != engine.fingerprint:
                raise EntryError(f"entry {i} was built for another model ({e.model_fingerprint[:12]})")
            if e.seam != want_seam:
                raise EntryError(f"entry {i} was built with seam {e.seam}, this prefill uses {want_seam}")
            if e.dtype != dtype_name(engine.dtype):
                raise EntryError(f"entry {i} was built in {e.dtype}, the engine runs {dtype_name(engine.dtype)}")
            if e.token_ids != s:
                raise EntryError(f"entry {i} holds other tokens than segment {i}")
    return segs, q


def prefill_segments(engine, segments, query, entries=None, mode: str = "hypic", seam: int = 8,
                     order: str = "segment"):
    """See HybridEngine.prefill_segments."""
    from common.engine import PrefillOutput

    segs, q = validate(engine, segments, query, entries, mode, seam)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    extra: dict = {"mode": mode, "timings": timings}
    if mode == "full":
        out = engine.prefill([t for s in segs for t in s] + q)
        timings["total_s"] = time.perf_counter() - t0
        out.extra.update(extra)
        return out
    if mode == "prefix":
        keys = chain_keys(engine.fingerprint, dtype_name(engine.dtype), segs)
        state, reused = None, 0
        for j in range(len(segs) - 1, -1, -1):
            hit = engine.prefix_cache.get(keys[j])
            if hit is not None:
                state, reused = hit, j + 1
                break
        if reused < len(segs):  # the uncached segments in one pass, a state kept at each end
            for j, st in enumerate(forward_segments(engine, segs[reused:], state), start=reused):
                engine.prefix_cache.put(keys[j], st)
                state = st
        extra["reused_segments"] = reused
        out = _query(engine, q, state)
    else:
        use_seam = 0 if mode == "naive" else seam
        t_build = time.perf_counter()
        built = []
        full_entries = []
        for i, s in enumerate(segs):
            e = entries[i] if entries is not None else None
            if e is None:
                e = build_entry(engine, s, use_seam)
                built.append(i)
            full_entries.append(e)
        timings["build_s"] = time.perf_counter() - t_build
        t_comp = time.perf_counter()
        if mode == "naive":
            state = prefill_segment_major(engine, full_entries, naive=True)
        elif order == "layer":
            state = prefill_layer_major(engine, full_entries)
        elif order == "segment":
            state = prefill_segment_major(engine, full_entries)
        else:
            raise ValueError(f"order must be 'segment' or 'layer', got {order!r}")
        timings["compose_s"] = time.perf_counter() - t_comp
        extra["entries"] = full_entries
        extra["built"] = built
        out = _query(engine, q, state)
    timings["total_s"] = time.perf_counter() - t0
    out.extra.update(extra)
    return out


def _query(engine, q, state):
    from common.engine import PrefillOutput

    _, logits, state = engine.forward(q, state)
    return PrefillOutput(logits=logits[-1], state=state)
