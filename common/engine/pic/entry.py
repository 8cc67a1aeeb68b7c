"""SegmentEntry: what Hypic caches for one segment, and its byte format.

An entry is built by prefilling the segment alone, as if it started the prompt. Its first `seam`
tokens are not cached (they are recomputed at reuse under the real prefix); the rest, the body, is
kept per layer:

- linear layer: the transition operator T and zero-start state S of the body's *cached span*
  (body tokens after the conv warm-up, see below), the conv tail (the last kernel-1 conv inputs
  of the body), and the layer inputs of the warm-up tokens: body tokens whose short conv would
  reach back before the segment (only when seam < kernel-1); they are re-run at reuse with the
  real conv state so that the linear layer sees exactly what the full run sees.
- full-attention layer: the body's keys and values at their cache-time positions (seam ..
  n_tokens-1); reuse rotates them to their real positions.

The linear part is stored in the entry's format (common.engine.pic.compact: fp32, bf16, fp8t or fp8
with per-head scales), named in the header and widened back to fp32 on parse; fp8 also stores the
attention keys and values in e4m3 with a scale per token and kv-head (header version 5, "kv":
"fp8"), widened back to the model dtype on parse. An entry's in-memory tensors are always what a
reader of its bytes sees (`with_format` rounds them). A delta-family T
of a span shorter than about half the key dimension is kept as its low-rank factors
(kernels.linear_attn.lowrank.LowRankT: T = diag(gamma) - P^T Q, gamma fp32, P and Q in the entry's
format), and the header's "lowrank" lists the layers that hold it (version 4); the layer kinds
stay "linear:matrix", and composition applies the factors without forming T.

Bytes: b"HYPE" | u32 header length | header JSON | safetensors payload | 16-byte digest. The
digest (common.engine.checksum) covers every byte before it, so a corrupted entry is refused, never
used; it is the one check of an entry's bytes on the hit path (readers skip the transport's).
The header JSON is padded with spaces so that the payload starts 8-aligned: parsing views the
tensors in the received buffer instead of copying them.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
from safetensors.torch import save as st_save

from common.engine.checksum import DIGEST_BYTES, checksum
from common.engine.dtypes import dtype_name, torch_dtype
from common.engine.pic.compact import (DEFAULT_ENTRY_FORMAT, ENTRY_FORMATS, FP8, KV_ENCODINGS, check_format, decode,
                                       decode_kv, encode, encode_kv, role_encoding, round_trip, round_trip_kv)
from common.engine.fingerprint import segment_key  # noqa: F401  (re-exported: the one definition)
from kernels.linear_attn import Summary, summary_form
from kernels.linear_attn.lowrank import LowRankT

MAGIC = b"HYPE"
FORMAT_VERSION = 3  # 3: "format" in the header (compact T/S); 2: trailing digest, 8-aligned; 1: blake2b
# fp32 entries are still written as version 2 (byte for byte what readers before formats expect);
# versions 1 and 2 read as format fp32
FP32_VERSION = 2
# 4: "lowrank" in the header (layers whose T is stored as factors) and "format" always named.
# Only entries with a low-rank layer are written as 4: every other entry is byte for byte what
# readers before it expect, and a reader before it refuses a version-4 entry cleanly (rebuilt).
LOWRANK_VERSION = 4
# 5: "kv" in the header: attention keys and values stored compact ("fp8", the fp8 format's). Only
# entries with an attention layer in such a format are written as 5 (an fp8 entry before it kept
# K/V in the model dtype and still reads so); readers before it refuse it cleanly (rebuilt).
KV_VERSION = 5
READ_VERSIONS = (1, FP32_VERSION, FORMAT_VERSION, LOWRANK_VERSION, KV_VERSION)
DIGEST_VERSIONS = (FP32_VERSION, FORMAT_VERSION, LOWRANK_VERSION, KV_VERSION)  # trailing digest, 8-aligned
PAYLOAD_ALIGN = 8


class EntryError(ValueError):
    """An entry that cannot be used: corrupted, or built for another model, seam or dtype."""


class EntryMismatch(EntryError):
    """A sound entry that does not fit the request (model, tokens, seam, dtype or layer layout)."""


def body_kind(body: "LinearBody | AttentionBody | None") -> str:
    """One layer's kind in an entry: "linear:<form>", "attention" or "none"."""
    if isinstance(body, LinearBody):
        return "linear:" + body.form
    return "attention" if isinstance(body, AttentionBody) else "none"


def entry_layout(model) -> list[str]:
    """The per-layer kinds (as `body_kind` names them) an entry for `model` must have."""
    out = []
    for layer in model.layers:
        if layer.kind == "linear":
            out.append("linear:" + summary_form(layer.mixer.family))
        else:
            out.append("attention" if layer.kind == "attention" else "none")
    return out


@dataclass
class LinearBody:
    T: torch.Tensor | LowRankT  # structured transition operator of the cached span (fp32), or its factors
    form: str  # "scalar" | "vector" | "matrix"
    S: torch.Tensor  # [1, H, K, V] zero-start end state of the cached span (fp32)
    conv_tail: torch.Tensor | None  # [1, C, <= kernel-1] conv inputs of the body's last tokens
    warmup_inputs: torch.Tensor | None  # [1, n_warm, D] mixer inputs of the warm-up tokens

    @property
    def summary(self) -> Summary:
        return Summary(self.T, self.S, self.form)


@dataclass
class AttentionBody:
    keys: torch.Tensor  # [1, kv_heads, body_len, D] rotated to positions seam..n_tokens-1
    values: torch.Tensor


@dataclass
class SegmentEntry:
    token_ids: list[int]
    seam: int  # seam width the entry was built with
    model_fingerprint: str
    dtype: str
    layers: list[LinearBody | AttentionBody | None] = field(default_factory=list)
    format: str = DEFAULT_ENTRY_FORMAT  # storage format of the linear part (common.engine.pic.compact)

    def with_format(self, fmt: str) -> "SegmentEntry":
        """This entry stored in format `fmt`: T (matrix form), S and (fp8) keys and values rounded
        as its bytes will hold them, so the builder composes with exactly what every reader sees."""
        check_format(fmt)
        if fmt == self.format:
            return self
        if self.format != "fp32":
            raise EntryError(f"an entry in {self.format} cannot be restored to {fmt}")
        kv = role_encoding(fmt, "kv")
        layers = [
            LinearBody(T=_rounded_T(b, fmt), form=b.form, S=round_trip(b.S, fmt, "S"),
                       conv_tail=b.conv_tail, warmup_inputs=b.warmup_inputs) if isinstance(b, LinearBody)
            else AttentionBody(round_trip_kv(b.keys, kv), round_trip_kv(b.values, kv)) if isinstance(b, AttentionBody)
            else b
            for b in self.layers
        ]
        return SegmentEntry(self.token_ids, self.seam, self.model_fingerprint, self.dtype, layers, fmt)

    @property
    def kv_encoding(self) -> str:
        """How this entry's bytes store attention keys and values (the header's "kv"): "model" when
        it has no attention layer or its format keeps them in the model dtype."""
        has_attention = any(isinstance(b, AttentionBody) for b in self.layers)
        return role_encoding(self.format, "kv") if has_attention else "model"

    @property
    def lowrank_layers(self) -> list[int]:
        """Indices of the layers whose T is held as low-rank factors (the header's "lowrank")."""
        return [i for i, b in enumerate(self.layers) if isinstance(b, LinearBody) and isinstance(b.T, LowRankT)]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seam_len(self) -> int:
        return min(self.seam, self.n_tokens)

    @property
    def body_len(self) -> int:
        return self.n_tokens - self.seam_len

    @property
    def seam_tokens(self) -> list[int]:
        return self.token_ids[: self.seam_len]

    @property
    def key(self) -> str:
        return segment_key(self.model_fingerprint, self.seam, self.dtype, self.token_ids)

    def nbytes(self) -> int:
        """Bytes of the stored tensors (in the entry's format)."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    @property
    def layout(self) -> list[str]:
        return [body_kind(b) for b in self.layers]

    def check(self, token_ids: Sequence[int], *, seam: int, fingerprint: str, dtype: torch.dtype | str,
              layout: Sequence[str] | None = None, entry_format: str | None = None) -> None:
        """The one check that this entry fits a request: built by the model `fingerprint` names,
        in `dtype`, with seam width `seam` (the request's effective seam, see common.engine.modes), for
        exactly `token_ids`, and (when given) with the model's per-layer `layout` (`entry_layout`) and
        stored in `entry_format` (a combine configured for fp32 entries never composes a lossy one).
        Raises EntryMismatch saying what differs."""
        if self.model_fingerprint != fingerprint:
            raise EntryMismatch(f"entry built for another model ({self.model_fingerprint[:12]})")
        if self.seam != seam:
            raise EntryMismatch(f"entry built with seam {self.seam}, the request uses {seam}")
        if self.dtype != dtype_name(dtype):
            raise EntryMismatch(f"entry built in {self.dtype}, the request uses {dtype_name(dtype)}")
        if self.token_ids != list(token_ids):
            raise EntryMismatch("entry holds other tokens than the segment")
        if layout is not None and self.layout != list(layout):
            raise EntryMismatch(f"entry layers {self.layout} do not fit the model's {list(layout)}")
        if entry_format is not None and self.format != entry_format:
            raise EntryMismatch(f"entry stored in {self.format}, the request expects {entry_format}")

    # -- bytes ------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, body in enumerate(self.layers):
            if isinstance(body, LinearBody) and isinstance(body.T, LowRankT):
                out[f"{i}.T.gamma"] = body.T.gamma  # K numbers a head: fp32 in every format
                out.update(encode(f"{i}.T.P", body.T.P, self.format, "T"))
                out.update(encode(f"{i}.T.Q", body.T.Q, self.format, "T"))
            elif isinstance(body, LinearBody):
                out.update(encode(f"{i}.T", body.T, self.format, "T" if body.form == "matrix" else None))
            if isinstance(body, LinearBody):
                out.update(encode(f"{i}.S", body.S, self.format, "S"))
                if body.conv_tail is not None:
                    out[f"{i}.conv"] = body.conv_tail
                if body.warmup_inputs is not None:
                    out[f"{i}.warm"] = body.warmup_inputs
            elif isinstance(body, AttentionBody):
                out.update(encode_kv(f"{i}.k", body.keys, self.kv_encoding))
                out.update(encode_kv(f"{i}.v", body.values, self.kv_encoding))
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}

    def to_bytes(self) -> bytes:
        payload = st_save(self._tensors())
        kinds = [
            "linear:" + b.form if isinstance(b, LinearBody) else "attention" if isinstance(b, AttentionBody) else "none"
            for b in self.layers
        ]
        header = dict(
            version=FP32_VERSION if self.format == "fp32" else FORMAT_VERSION, token_ids=self.token_ids, seam=self.seam, fingerprint=self.model_fingerprint,
            dtype=self.dtype, layers=kinds,
        )
        if self.format != "fp32":
            header["format"] = self.format
        if self.lowrank_layers:
            header.update(version=LOWRANK_VERSION, format=self.format, lowrank=self.lowrank_layers)
        if self.kv_encoding != "model":
            header.update(version=KV_VERSION, format=self.format, lowrank=self.lowrank_layers, kv=self.kv_encoding)
        hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        # trailing spaces (valid JSON) so the payload, and with it every tensor, starts 8-aligned
        hb += b" " * (-(8 + len(hb)) % PAYLOAD_ALIGN)
        body = MAGIC + struct.pack("<I", len(hb)) + hb + payload
        return body + checksum(body)

    @classmethod
    def from_bytes(cls, data, device="cpu", sealed: bool = False) -> "SegmentEntry":
        """Parse and verify an entry: every byte is checked once, here, where it lands (readers
        of segcache and scatter pass verify=False to the transport for entries).

        data: any bytes-like object; writable buffers (bytearray, numpy) are viewed, not copied:
        the tensors share its memory, so the caller must not reuse it.
        sealed: the caller has just opened these bytes' seal (common.engine.pic.seal.open_sealed), whose
        tag (a MAC) covers every byte, the digest included: that is their one check, the digest is not
        computed again. Everything else (magic, header, payload layout) is checked as always."""
        mv = memoryview(data).cast("B")
        if mv.readonly:
            mv = memoryview(bytearray(mv))  # tensors must not alias immutable memory
        if len(mv) < 8 or mv[:4] != MAGIC:
            raise EntryError("not a segment entry (bad magic)")
        (n,) = struct.unpack("<I", mv[4:8])
        try:
            header = json.loads(bytes(mv[8 : 8 + n]))
        except ValueError as e:
            raise EntryError(f"corrupted entry header: {e}") from None
        version, fmt, lowrank, kv = header_format(header)
        if version in DIGEST_VERSIONS:
            if len(mv) < 8 + n + DIGEST_BYTES:
                raise EntryError("truncated entry")
            if not sealed and checksum(mv[:-DIGEST_BYTES]) != bytes(mv[-DIGEST_BYTES:]):
                raise EntryError("entry checksum mismatch: corrupted bytes")
            payload = mv[8 + n : -DIGEST_BYTES]
        elif version == 1:  # written before common.engine.checksum: blake2b of the payload in the header
            payload = mv[8 + n :]
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
                raise EntryError("entry checksum mismatch: corrupted payload")
        else:
            raise EntryError(f"entry format version {version} (expected one of {READ_VERSIONS})")
        tensors = _view_safetensors(payload)
        try:
            layers = [_layer(tensors, i, kind, device, fmt, i in lowrank, kv, header["dtype"])
                      for i, kind in enumerate(header["layers"])]
            if any(not (0 <= i < len(layers) and getattr(layers[i], "form", None) == "matrix") for i in lowrank):
                raise ValueError(f"lowrank layers {lowrank} are not all matrix-T linear layers")
            return cls(header["token_ids"], header["seam"], header["fingerprint"], header["dtype"], layers, fmt)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise EntryError(f"malformed entry header: {e!r}") from None


def header_format(header) -> tuple[object, str, list[int], str]:
    """(version, storage format, low-rank layers, K/V encoding) an entry's parsed header JSON names
    (format fp32 before version 3, no low-rank layers before 4, K/V in the model dtype before 5);
    EntryError for an unknown format or K/V encoding or a malformed "lowrank". The version itself
    is the caller's to accept or refuse."""
    version = header.get("version") if isinstance(header, dict) else None
    fmt = header.get("format", "fp32") if version in (FORMAT_VERSION, LOWRANK_VERSION, KV_VERSION) else "fp32"
    if fmt not in ENTRY_FORMATS:
        raise EntryError(f"unknown entry format {fmt!r}")
    lowrank = header.get("lowrank", []) if version in (LOWRANK_VERSION, KV_VERSION) else []
    if not isinstance(lowrank, list) or not all(isinstance(i, int) for i in lowrank):
        raise EntryError(f"malformed entry header: lowrank layers {lowrank!r}")
    kv = header.get("kv", "model") if version == KV_VERSION else "model"
    if kv not in KV_ENCODINGS:
        raise EntryError(f"unknown K/V encoding {kv!r}")
    return version, fmt, lowrank, kv


def _rounded_T(body: LinearBody, fmt: str) -> torch.Tensor | LowRankT:
    """body's T as an entry in format `fmt` stores it: a matrix T or the factors P and Q rounded,
    scalar and vector T and gamma as they are (fp32)."""
    if isinstance(body.T, LowRankT):
        return LowRankT(body.T.gamma, round_trip(body.T.P, fmt, "T"), round_trip(body.T.Q, fmt, "T"))
    return round_trip(body.T, fmt, "T") if body.form == "matrix" else body.T


def _stored_T(tensors: dict[str, torch.Tensor], i: int, fmt: str, lowrank: bool) -> torch.Tensor | LowRankT:
    """Layer i's T from the payload: the dense tensor, or (lowrank) its factors, widened to fp32."""
    if not lowrank:
        return decode(tensors, f"{i}.T", fmt, "T")
    T = LowRankT(decode(tensors, f"{i}.T.gamma", "fp32"), decode(tensors, f"{i}.T.P", fmt, "T"),
                 decode(tensors, f"{i}.T.Q", fmt, "T"))
    if T.gamma.dim() < 1 or T.P.shape != T.Q.shape or T.P.shape[:-2] != T.gamma.shape[:-1] \
            or T.P.shape[-1] != T.gamma.shape[-1]:
        raise ValueError(f"low-rank T of layer {i}: gamma {tuple(T.gamma.shape)}, P {tuple(T.P.shape)}, "
                         f"Q {tuple(T.Q.shape)} do not fit")
    return T


def _layer(tensors: dict[str, torch.Tensor], i: int, kind: str, device, fmt: str = "fp32", lowrank: bool = False,
           kv: str = "model", dtype: str = "float32") -> LinearBody | AttentionBody | None:
    """Layer i of a parsed payload: T and S widened to fp32, keys and values (kv "fp8") to the
    model's `dtype` (the header's), on `device`."""
    if kind.startswith("linear:"):
        opt = lambda name: tensors[name].to(device) if name in tensors else None  # noqa: E731
        T, S = _stored_T(tensors, i, fmt, lowrank).to(device), decode(tensors, f"{i}.S", fmt, "S").to(device)
        return LinearBody(T=T, form=kind.split(":", 1)[1], S=S,
                          conv_tail=opt(f"{i}.conv"), warmup_inputs=opt(f"{i}.warm"))
    if kind == "attention":
        model_dtype = torch_dtype(dtype) if kv != "model" else None
        return AttentionBody(decode_kv(tensors, f"{i}.k", kv, model_dtype).to(device),
                             decode_kv(tensors, f"{i}.v", kv, model_dtype).to(device))
    return None


# -- safetensors payload, viewed in place (safetensors.torch.load copies every tensor) -------
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": FP8}


def _view_safetensors(payload: memoryview) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors buffer as views of it (a tensor that is not aligned to its
    element size is copied); any inconsistency is an EntryError."""
    if len(payload) < 8:
        raise EntryError("truncated payload")
    (n,) = struct.unpack("<Q", payload[:8])
    if n > len(payload) - 8:
        raise EntryError("truncated payload header")
    try:
        meta = json.loads(bytes(payload[8 : 8 + n]))
    except ValueError as e:
        raise EntryError(f"corrupted payload header: {e}") from None
    base, size = 8 + n, len(payload) - 8 - n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EntryError(f"bad payload header for tensor {name!r}") from None
        numel = math.prod(shape)
        item = torch.empty((), dtype=dtype).element_size()
        if not (0 <= a <= b <= size and b - a == numel * item):
            raise EntryError(f"tensor {name!r} does not fit the payload")
        out[name] = _view(payload, base + a, numel, dtype, item).view(shape)
    return out


def _view(buf: memoryview, offset: int, numel: int, dtype: torch.dtype, item: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # numpy buffers of segcache reads: fine to alias
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
    return t.clone() if t.data_ptr() % item else t  # misaligned (a version-1 entry): copy it
