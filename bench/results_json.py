"""Benchmark results as JSON files.

Reading results written by earlier versions: the additive ablation was called "naive" then (its
keys "naive", "naive_s"; "naive" in a "modes" list). `load` renames those to today's names
(common.engine.modes), so every reader sees one vocabulary; new results are written with today's
names and nothing is regenerated for the rename.

Writing (`dumps`): indented like json.dumps(indent=1), except that a list of numbers is one line
and a list of objects of numbers, strings and such lists or objects (per-request records) is one
object a line: a serving run's thousands of records then read a line each in a diff, and
serve.json is two thirds of its size with one field a line (574 against 851 KB).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

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


def _flat(x: Any) -> bool:
    return not isinstance(x, (dict, list)) or (isinstance(x, list) and all(_flat(v) and not isinstance(v, list)
                                                                          for v in x))


def dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
    """`obj` as JSON (module docstring); `default` as json.dumps's. json.loads(dumps(x)) == x."""
    one = lambda x: json.dumps(x, default=default)  # noqa: E731

    def enc(x: Any, pad: str) -> str:
        inner = pad + " "
        if isinstance(x, dict):
            if not x:
                return "{}"
            return "{\n" + ",\n".join(f"{inner}{json.dumps(str(k))}: {enc(v, inner)}" for k, v in x.items()) + \
                "\n" + pad + "}"
        if isinstance(x, (list, tuple)):
            if all(_flat(v) for v in x):
                return one(list(x))
            if all(isinstance(v, dict) and all(_flat(w) or (isinstance(w, dict) and all(map(_flat, w.values())))
                                               for w in v.values()) for v in x):
                return "[\n" + ",\n".join(inner + one(v) for v in x) + "\n" + pad + "]"
            return "[\n" + ",\n".join(inner + enc(v, inner) for v in x) + "\n" + pad + "]"
        if default is not None and not isinstance(x, (str, int, float, bool, type(None))):
            return enc(default(x), pad)
        return one(x)

    return enc(obj, "") + "\n"
