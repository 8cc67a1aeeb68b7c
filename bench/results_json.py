"""Reading benchmark results written by earlier versions: the additive ablation was called
"naive" then (its keys "naive", "naive_s"; "naive" in a "modes" list). `load` renames those to
today's names (common.engine.modes), so every reader sees one vocabulary; new results are written with
today's names and nothing is regenerated for the rename.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.engine.modes import ALIASES


def _canonical(name: Any) -> Any:
    if not isinstance(name, str):
        return name
    stem, suffix = (name[:-2], "_s") if name.endswith("_s") else (name, "")
    return ALIASES[stem] + suffix if stem in ALIASES else name


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key == "modes" and isinstance(value, list):
            value = [_canonical(v) for v in value]
        out[_canonical(key)] = value
    return out


def loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_pairs)


def load(path: Path) -> Any:
    return loads(Path(path).read_text())
