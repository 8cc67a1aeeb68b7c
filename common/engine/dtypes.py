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


def name_of(dtype: Any) -> str:
    """'float32' for "float32" or torch.float32, unchecked (a content address may name any dtype:
    common.engine.fingerprint.segment_key of a forged header must give a key, not raise)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def dtype_name(dtype: Any) -> str:
    """The name of a served dtype given as a torch dtype or its name; ValueError for any other."""
    return check_dtype_name(name_of(dtype))


# Storage formats of an entry's linear part (common.engine.pic.compact); named here, beside the
# dtypes, so that worker configs (common.mesh) check the name without loading the engine.
ENTRY_FORMATS = ("fp32", "bf16", "fp8t", "fp8")
# The format model workers (scatter, combine) store entries in unless configured otherwise
# (WorkerConfig.entry_format, HybridEngine.for_worker). bf16 because it was measured lossless in
# practice: on the bundled model's quality tasks no answer differs from fp32 entries'
# (bench/quality/results/quality_formats.json) and the next-token KL it adds is <= 1e-5 nats on
# every tiny architecture and the mid-size random model (bench/results/entry_format_error.json),
# for half the bytes of T and S. Not fp8t (T in fp8, S bf16; Qwen3.5/Qwen3-Next break even at
# 793 tokens instead of 1,048): every task scores the same, but on the bundled model its KL against
# fp32 entries is fp8's order, 6e-6 to 1.1e-2 nats per task against bf16's 3e-8 to 4.5e-5.
# A library HybridEngine keeps exact fp32 entries
# (common.engine.pic.compact.DEFAULT_ENTRY_FORMAT: the format an entry is built and composed in).
WORKER_ENTRY_FORMAT = "bf16"


def check_entry_format(name: str) -> str:
    """`name` if it is one of ENTRY_FORMATS; ValueError otherwise."""
    if name not in ENTRY_FORMATS:
        raise ValueError(f"entry format must be one of {', '.join(ENTRY_FORMATS)}, not {name!r}")
    return name
