"""Storage formats of an entry's tensors, chosen per entry and named in its header.

Each format stores each tensor role in one element encoding:

    format  T (matrix T; low-rank P, Q)  S           attention K/V
    fp32    fp32                         fp32        model dtype (every entry written before formats)
    bf16    bf16                         bf16        model dtype (half the bytes of T and S)
    fp8t    fp8 e4m3, per-head scale     bf16        model dtype
    fp8     fp8 e4m3, per-head scale     fp8 e4m3,   fp8 e4m3, one fp32 scale per token and kv-head
                                         per-head    (entries written before it: model dtype)

    bf16 encoding  x rounded to bfloat16; widened to fp32 on parse
    fp8 per head   x = q * scale, scale = amax(|x| over the head's K x K / K x V / L x K block) / 448,
                   one fp32 scale per head and tensor (`head_scale`)
    fp8 per token  (K/V) x = q * scale, scale = 2^ceil(log2(amax(|x| over the token's head_dim) / 448)),
                   one fp32 scale per token and kv-head (`token_scale`), widened to the model dtype on parse

fp8t ("fp8 T") exists because T and S err differently: S is the state every later token reads, T
only carries an incoming state across the segment, and the bundled model's quality run puts fp8's
KL about 100x bf16's. fp8t keeps S (and everything bf16 compacts) in bf16 and quarters T, the
largest tensor of a K x K family.

K/V scales: vLLM and SGLang quantise their KV cache with calibrated per-tensor (or per-head)
scales, because they write one token at a time during decode; an entry's K/V are written once,
whole, so each token and kv-head gets its own scale from its own amax. A power of two, so that q *
scale is exact in the model dtype: a token widened on parse and encoded again gives the same bytes
(the in-memory entry is what its readers see), and e4m3's relative precision (3 mantissa bits)
does not depend on the scale. Old fp8 entries (K/V in the model dtype) still open: the header
says which (common.engine.pic.entry: version 5, "kv": "fp8").

A delta-family T held as low-rank factors (kernels.linear_attn.lowrank.LowRankT, T = diag(gamma) -
P^T Q) stores P and Q like a matrix T (each with its own per-head fp8 scale) and gamma in fp32;
`matrix_T_bytes` and `lowrank_T_bytes` count both ways, and `lowrank_is_smaller` is the builder's
automatic choice between them.

Scalar and vector T are a few bytes per head and stay fp32 in every format; conv tails and warm-up
inputs stay in the model dtype. Composition always runs in fp32: a compact T or S is widened once,
where the entry is parsed, so everything downstream (common.engine.pic.reuse, kernels.compose)
sees the same fp32 tensors in every format, and attention code the same model-dtype K/V.
"""
from __future__ import annotations

import torch

from common.engine.dtypes import ENTRY_FORMATS, check_entry_format

DEFAULT_ENTRY_FORMAT = "fp32"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
TINY = torch.finfo(torch.float32).tiny  # smallest normal fp32: the floor of every fp8 scale

# format -> role -> element encoding ("model": the model dtype, as built)
ROLE_ENCODINGS: dict[str, dict[str, str]] = {
    "fp32": dict(T="fp32", S="fp32", kv="model"),
    "bf16": dict(T="bf16", S="bf16", kv="model"),
    "fp8t": dict(T="fp8", S="bf16", kv="model"),
    "fp8": dict(T="fp8", S="fp8", kv="fp8"),
}
assert tuple(ROLE_ENCODINGS) == ENTRY_FORMATS, "a format named in common.engine.dtypes needs its encodings here"
KV_ENCODINGS = ("model", "fp8")  # what an entry header's "kv" may name

check_format = check_entry_format


def role_encoding(fmt: str, role: str) -> str:
    """The element encoding format `fmt` stores a tensor of `role` ("T", "S" or "kv") in."""
    return ROLE_ENCODINGS[check_format(fmt)][role]


def head_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-head fp8 scale of x [..., H, a, b]: amax over the last two dims / FP8_MAX (1 where the
    head is all zeros, so dividing by it is always defined). Never below float32's smallest normal:
    a head that has decayed to denormals (amax 1.4e-45 seen on a trained model) would otherwise get
    a scale of 0 and store 0/0 = NaN; with the floor its values round to fp8's zero."""
    amax = x.detach().float().abs().amax(dim=(-2, -1))
    scale = (amax / FP8_MAX).clamp_min(TINY)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def token_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token fp8 scale of keys or values x [..., L, D]: the smallest power of two >= amax over
    the last dim / FP8_MAX (so no value clips), floored at float32's smallest normal as
    `head_scale` is; 1 for an all-zero token (or an empty last dim: an MLA entry's empty values)."""
    x = x.detach().float()
    amax = x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    scale = torch.exp2(torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(TINY))))
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def encode(name: str, x: torch.Tensor, fmt: str, role: str | None) -> dict[str, torch.Tensor]:
    """The payload tensors that store x (a fp32 T or S) under `name` in format `fmt`; role "T" or
    "S" (None: x is one of the tensors every format keeps as it is)."""
    enc = "fp32" if role is None else role_encoding(fmt, role)
    if enc == "fp32":
        return {name: x}
    if enc == "bf16":
        return {name: x.float().to(torch.bfloat16)}
    scale = head_scale(x)
    return {name: _to_fp8(x, scale[..., None, None]), name + ".scale": scale}


def decode(tensors: dict[str, torch.Tensor], name: str, fmt: str, role: str | None = None) -> torch.Tensor:
    """x widened back to fp32 from what `encode` stored (fp32 tensors are returned as they are);
    ValueError when the stored dtype is not the one `fmt` stores a tensor of `role` in (role None:
    either of T's and S's)."""
    x = tensors[name]
    if x.dtype == torch.float32:
        return x
    encs = {role_encoding(fmt, r) for r in (("T", "S") if role is None else (role,))}
    if x.dtype == torch.bfloat16 and "bf16" in encs:
        return x.float()
    if x.dtype == FP8 and "fp8" in encs:
        scale = tensors[name + ".scale"]
        if tuple(scale.shape) != tuple(x.shape[:-2]):
            raise ValueError(f"scale of {name!r} has shape {tuple(scale.shape)}, want {tuple(x.shape[:-2])}")
        return x.float() * scale.float()[..., None, None]
    raise ValueError(f"tensor {name!r} is {x.dtype}, which format {fmt!r} does not store")


def round_trip(x: torch.Tensor, fmt: str, role: str = "T") -> torch.Tensor:
    """x (a T or S: `role`) as a reader of an entry in format `fmt` sees it (fp32): what the
    builder must use too."""
    return decode(encode("x", x, fmt, role), "x", fmt, role)


def encode_kv(name: str, x: torch.Tensor, kv: str) -> dict[str, torch.Tensor]:
    """The payload tensors that store attention keys or values x [..., L, D] (model dtype) in K/V
    encoding `kv` ("model": as they are; "fp8": e4m3 with `token_scale`)."""
    if kv == "model":
        return {name: x}
    scale = token_scale(x)
    return {name: _to_fp8(x, scale[..., None]), name + ".scale": scale}


def decode_kv(tensors: dict[str, torch.Tensor], name: str, kv: str, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values widened to the model `dtype` from what `encode_kv` stored under encoding
    `kv` (the entry header's); ValueError when the stored tensors do not fit it."""
    x = tensors[name]
    if kv == "model":
        if x.dtype == FP8:
            raise ValueError(f"tensor {name!r} is fp8, but the entry header says its K/V are in the model dtype")
        return x
    if x.dtype != FP8 or kv != "fp8":
        raise ValueError(f"tensor {name!r} is {x.dtype}, which K/V encoding {kv!r} does not store")
    scale = tensors[name + ".scale"]
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"scale of {name!r} is {scale.dtype} {tuple(scale.shape)}, want fp32 {tuple(x.shape[:-1])}")
    return (x.float() * scale[..., None]).to(dtype)


def round_trip_kv(x: torch.Tensor, kv: str) -> torch.Tensor:
    """Keys or values as a reader of an entry with K/V encoding `kv` sees them (x's dtype)."""
    return decode_kv(encode_kv("x", x, kv), "x", kv, x.dtype)


ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}  # bytes of one number in each element encoding
SCALE_BYTES = 4  # fp8: one fp32 scale per head and compact tensor (per token and kv-head for K/V)


def tensor_bytes(H: int, numel_per_head: int, fmt: str, role: str) -> int:
    """Bytes of H heads' blocks of `numel_per_head` numbers of a T or S (`role`) stored in `fmt`."""
    enc = role_encoding(fmt, role)
    return H * (numel_per_head * ITEM_BYTES[enc] + (SCALE_BYTES if enc == "fp8" else 0))


def kv_token_bytes(numel: int, heads: int, fmt: str, dtype_bytes: int) -> int:
    """Bytes of one token's keys or values, `numel` numbers over `heads` kv-heads (MLA: 1), stored
    in `fmt` by a model whose dtype has `dtype_bytes` bytes."""
    if role_encoding(fmt, "kv") == "model":
        return numel * dtype_bytes
    return numel + heads * SCALE_BYTES


def matrix_T_bytes(H: int, K: int, fmt: str) -> int:
    """Bytes of H heads' dense K x K T stored in `fmt`."""
    return tensor_bytes(H, K * K, fmt, "T")


def lowrank_T_bytes(H: int, L: int, K: int, fmt: str) -> int:
    """Bytes of H heads' low-rank T of rank L stored in `fmt`: P and Q [L, K] like T (each with
    its fp8 scale), gamma [K] fp32."""
    return 2 * tensor_bytes(H, L * K, fmt, "T") + H * 4 * K


def lowrank_is_smaller(L: int, K: int, fmt: str) -> bool:
    """Whether a span of L tokens stores its T in fewer bytes as factors than as the K x K matrix
    (fp32: 2 L + 1 < K; the automatic choice of common.engine.pic.build)."""
    return lowrank_T_bytes(1, L, K, fmt) < matrix_T_bytes(1, K, fmt)
