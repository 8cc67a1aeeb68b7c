"""The family table: every fact about a linear-attention family that the kernels branch on.

    family          gate       delta   T form   default scale
    retnet          head       no      scalar   K^-1/2
    mamba2          token      no      scalar   1 (y = C^T S)
    gla             channel    no      vector   K^-1/2
    deltanet        -          yes     matrix   K^-1/2
    gated_deltanet  token      yes     matrix   K^-1/2
    kda             channel    yes     matrix   K^-1/2
    mamba           channel    no      vector   1 (Mamba v1: one head per inner channel, V = 1)

gate: the log-decay g each family takes, None, "head" ([H]), "token" ([B,T,H]) or "channel"
([B,T,H,K]); delta: the delta rule (I - beta k k^T) with beta [B,T,H]; form: the structured shape
of a segment's transition operator T (kernels.linear_attn.summary).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    gate: str | None  # None | "head" | "token" | "channel"
    delta: bool
    unit_scale: bool = False  # default scale 1 instead of K^-1/2

    @property
    def form(self) -> str:
        """Form of the segment transition T: "matrix" (delta rule), "vector" (per-channel gate), "scalar"."""
        if self.delta:
            return "matrix"
        return "vector" if self.gate == "channel" else "scalar"


_TABLE = (
    Family("retnet", "head", False),
    Family("mamba2", "token", False, unit_scale=True),
    Family("gla", "channel", False),
    Family("deltanet", None, True),
    Family("gated_deltanet", "token", True),
    Family("kda", "channel", True),
    Family("mamba", "channel", False, unit_scale=True),  # kernels/linear_attn/mamba.py
)
FAMILY = {f.name: f for f in _TABLE}
FAMILIES = tuple(FAMILY)
DELTA_FAMILIES = tuple(f.name for f in _TABLE if f.delta)
FAMILY_GATE = {f.name: f.gate for f in _TABLE}


def family(name: str) -> Family:
    """The table row of `name`; ValueError for an unknown family."""
    if name not in FAMILY:
        raise ValueError(f"unknown family {name!r}; expected one of {FAMILIES}")
    return FAMILY[name]


def check_inputs(name: str, g, beta) -> Family:
    """The row of `name`, after checking that the gate and beta it needs are given."""
    f = family(name)
    if f.gate is not None and g is None:
        raise ValueError(f"{name} needs a gate g")
    if f.delta and beta is None:
        raise ValueError(f"{name} needs beta")
    return f


__all__ = ["DELTA_FAMILIES", "FAMILIES", "FAMILY", "FAMILY_GATE", "Family", "check_inputs", "family"]
