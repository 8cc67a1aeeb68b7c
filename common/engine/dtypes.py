"""The one table of the dtypes a model is served in, by name (flags, wire, entry headers).

Pure Python at import: the router and the configs check names without loading torch;
`torch_dtype` / `dtype_name` map to and from torch only when called (the engine's side).
"""
from __future__ import annotations

from typing import Any

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def check_dtype_name(name: str) -> str:
    """`name` when it is a served dtype; ValueError naming the choices otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, not {name!r}")
    return name


def torch_dtype(name: str) -> Any:
    """The torch dtype named `name` (one of DTYPE_NAMES)."""
    import torch

    return getattr(torch, check_dtype_name(name))


def dtype_name(dtype: Any) -> str:
    """The name of a served torch dtype; ValueError for any other."""
    name = str(dtype).removeprefix("torch.")
    return check_dtype_name(name)
