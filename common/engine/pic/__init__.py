"""Position-independent caching of prompt segments (docs/design.md §2, §3, §6).

`prefill_segments` runs one prompt `seg_1 .. seg_n, query` in one of four modes:
full (recompute everything), prefix (exact reuse of a cached segment-aligned prefix),
additive (the ablation: entries concatenated by state addition, no T, no seams; "naive" is its
old name, still accepted) and hypic.

The package's names load lazily (PEP 562): segcache imports `common.engine.pic.seal` alone, and a
package __init__ that imported torch and the models would cost its start-up ~20 s for nothing.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "MODES": "common.engine.modes",
    "AttentionBody": "common.engine.pic.entry", "EntryError": "common.engine.pic.entry",
    "EntryMismatch": "common.engine.pic.entry", "LinearBody": "common.engine.pic.entry",
    "SegmentEntry": "common.engine.pic.entry", "segment_key": "common.engine.pic.entry",
    "PicEngine": "common.engine.pic.protocol", "PrefixCache": "common.engine.pic.prefix",
    "BuildCancelled": "common.engine.pic.build", "build_entry": "common.engine.pic.build",
    "compose_run": "common.engine.pic.reuse", "compose_segment": "common.engine.pic.reuse",
    "prefill_layer_major": "common.engine.pic.reuse", "prefill_segment_major": "common.engine.pic.reuse",
    "prefill_segments": "common.engine.pic.prefill", "validate": "common.engine.pic.prefill",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
