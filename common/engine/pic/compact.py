"""Storage formats of an entry's linear part (T and S), chosen per entry and named in its header.

    fp32   T and S as composed (the format of every entry written before formats existed)
    bf16   matrix T and S rounded to bfloat16 (half the bytes); widened to fp32 on parse
    fp8    matrix T and S in float8 e4m3 with one fp32 scale per head (a quarter of the bytes):
           x = q * scale, scale = amax(|x| over the head's K x K or K x V block) / 448

A delta-family T held as low-rank factors (kernels.linear_attn.lowrank.LowRankT, T = diag(gamma) -
P^T Q) stores P and Q like a matrix T (each with its own per-head fp8 scale) and gamma in fp32;
`matrix_T_bytes` and `lowrank_T_bytes` count both ways, and `lowrank_is_smaller` is the builder's
automatic choice between them.

Scalar and vector T are a few bytes per head and stay fp32 in every format; conv tails, warm-up
inputs and attention keys/values are already in the model dtype and are not touched. Composition
always runs in fp32: a compact tensor is widened once, where the entry is parsed, so everything
downstream (common.engine.pic.reuse, kernels.compose) sees the same fp32 tensors in every format.
"""
from __future__ import annotations

import torch

from common.engine.dtypes import ENTRY_FORMATS, check_entry_format

DEFAULT_ENTRY_FORMAT = "fp32"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


check_format = check_entry_format


def head_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-head fp8 scale of x [..., H, a, b]: amax over the last two dims / FP8_MAX (1 where the
    head is all zeros, so dividing by it is always defined). Never below float32's smallest normal:
    a head that has decayed to denormals (amax 1.4e-45 seen on a trained model) would otherwise get
    a scale of 0 and store 0/0 = NaN; with the floor its values round to fp8's zero."""
    amax = x.detach().float().abs().amax(dim=(-2, -1))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def encode(name: str, x: torch.Tensor, fmt: str, compact: bool) -> dict[str, torch.Tensor]:
    """The payload tensors that store x under `name` in format `fmt` (`compact` False: x is one of
    the tensors every format keeps as it is)."""
    if not compact or fmt == "fp32":
        return {name: x}
    if fmt == "bf16":
        return {name: x.float().to(torch.bfloat16)}
    scale = head_scale(x)
    q = (x.float() / scale[..., None, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return {name: q, name + ".scale": scale}


def decode(tensors: dict[str, torch.Tensor], name: str, fmt: str) -> torch.Tensor:
    """x widened back to fp32 from what `encode` stored (fp32 tensors are returned as they are)."""
    x = tensors[name]
    if x.dtype == torch.float32:
        return x
    if x.dtype == torch.bfloat16 and fmt == "bf16":
        return x.float()
    if x.dtype == FP8 and fmt == "fp8":
        scale = tensors[name + ".scale"]
        if tuple(scale.shape) != tuple(x.shape[:-2]):
            raise ValueError(f"scale of {name!r} has shape {tuple(scale.shape)}, want {tuple(x.shape[:-2])}")
        return x.float() * scale.float()[..., None, None]
    raise ValueError(f"tensor {name!r} is {x.dtype}, which format {fmt!r} does not store")


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x as a reader of an entry in format `fmt` sees it (fp32): what the builder must use too."""
    return decode(encode("x", x, fmt, True), "x", fmt)


ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}  # bytes of one compact number in each format
SCALE_BYTES = 4  # fp8: one fp32 scale per head and compact tensor


def matrix_T_bytes(H: int, K: int, fmt: str) -> int:
    """Bytes of H heads' dense K x K T stored in `fmt`."""
    return H * (K * K * ITEM_BYTES[fmt] + (SCALE_BYTES if fmt == "fp8" else 0))


def lowrank_T_bytes(H: int, L: int, K: int, fmt: str) -> int:
    """Bytes of H heads' low-rank T of rank L stored in `fmt`: P and Q [L, K] compact (each with
    its fp8 scale), gamma [K] fp32."""
    return H * (2 * L * K * ITEM_BYTES[fmt] + (2 * SCALE_BYTES if fmt == "fp8" else 0) + 4 * K)


def lowrank_is_smaller(L: int, K: int, fmt: str) -> bool:
    """Whether a span of L tokens stores its T in fewer bytes as factors than as the K x K matrix
    (fp32: 2 L + 1 < K; the automatic choice of common.engine.pic.build)."""
    return lowrank_T_bytes(1, L, K, fmt) < matrix_T_bytes(1, K, fmt)
