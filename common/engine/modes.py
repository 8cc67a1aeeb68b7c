"""The prefill modes: the one table of their names, their wire values and the seam rule.

full      recompute every token (the quality reference);
prefix    exact reuse of a cached segment-aligned prefix only (the baseline);
additive  the ablation: cached entries added without T, no seams ("naive" was its name; still
          accepted on input for one version, so that "naive" means only "reference implementation");
hypic     cached entries composed with T, seams recomputed (the default).

Pure Python on purpose: the engine imports this and must not load protobuf or anything of the
RPC stack. The wire values equal the proto enum `PrefillMode` (tests/test_modes.py checks both).
"""
from __future__ import annotations

MODES = ("full", "prefix", "additive", "hypic")
ALIASES = {"naive": "additive"}  # old name -> canonical name, accepted on input only
DEFAULT = "hypic"
# How tables, plots and logs for people name them (benchmarks, README).
LABELS = {"full": "full recompute", "prefix": "prefix cache", "additive": "additive PIC", "hypic": "hypic"}

# Canonical name -> protos.hypic.v1 PrefillMode value.
_WIRE = {"hypic": 0, "full": 1, "prefix": 2, "additive": 3}
_NAME_OF_WIRE = {value: name for name, value in _WIRE.items()}


def parse_mode(name: str) -> str:
    """The canonical mode for `name` (case-insensitive, aliases accepted); ValueError if unknown."""
    if not isinstance(name, str):
        raise ValueError(f"mode must be a name, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODES:
        raise ValueError(f"unknown mode {name!r}; one of {', '.join(MODES)}")
    return key


def seam_for(mode: str, seam: int) -> int:
    """The seam width entries of `mode` are built with: additive means seam 0 (no seams)."""
    return 0 if parse_mode(mode) == "additive" else seam


def uses_entries(mode: str) -> bool:
    """Whether `mode` composes cached segment entries (and so fetches/stores them)."""
    return parse_mode(mode) in ("additive", "hypic")


def to_wire(mode: str) -> int:
    """The PrefillMode enum value of `mode` (name or alias)."""
    return _WIRE[parse_mode(mode)]


def from_wire(value: int) -> str:
    """The canonical mode of a PrefillMode enum value; ValueError if it is not one."""
    try:
        return _NAME_OF_WIRE[int(value)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"unknown prefill mode {value!r}") from None
