"""Per-role encodings of the entry formats (common.engine.pic.compact): fp8t's T in fp8 and S in
bf16, and the fp8 format's attention keys and values in e4m3 with a scale per token and kv-head,
each against a plain per-element reference on random inputs; the K/V scale floor; version-5
headers ("kv") and their inconsistencies refused cleanly."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from common.engine.checksum import DIGEST_BYTES, checksum
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.compact import (FP8, FP8_MAX, decode, decode_kv, encode, encode_kv, head_scale, round_trip,
                                       round_trip_kv, token_scale)
from common.engine.pic.entry import AttentionBody, EntryError, SegmentEntry
from common.engine.pic.seal import header_of
from tests.support.tiny import PIC_CONFIGS, save_tiny

TINY = torch.finfo(torch.float32).tiny


def reference_kv(x: torch.Tensor) -> torch.Tensor:
    """The fp8 K/V encoding one token and head at a time, in plain Python arithmetic: scale the
    smallest power of two >= amax / 448 (floor: fp32's smallest normal; 1 for a zero token)."""
    flat = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    for r in range(flat.shape[0]):
        amax = max(abs(float(v)) for v in flat[r])
        scale = 1.0 if amax == 0 else max(2.0 ** math.ceil(math.log2(max(amax / FP8_MAX, TINY))), TINY)
        q = (flat[r] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
        out[r] = q * scale
    return out.reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_kv_matches_the_reference_on_random_tokens(dtype, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    heads, L, D = 3, 11, 16
    # tokens of very different magnitudes: the per-token scale must adapt to each
    x = (torch.randn(1, heads, L, D, generator=g) * torch.logspace(-3, 3, L)[None, None, :, None]).to(dtype)
    stored = encode_kv("k", x, "fp8")
    assert stored["k"].dtype == FP8 and stored["k.scale"].dtype == torch.float32
    assert tuple(stored["k.scale"].shape) == (1, heads, L)
    got = decode_kv(stored, "k", "fp8", dtype)
    assert got.dtype == dtype and torch.equal(got, reference_kv(x))
    err = (got.float() - x.float()).abs()
    # e4m3's 3 mantissa bits: relative error <= 2^-4 of each value, or half a subnormal step of
    # the token's scale (2^-10 scale) for values below e4m3's normal range
    bound = torch.maximum(x.float().abs() * 2 ** -4, stored["k.scale"][..., None] * 2 ** -10)
    assert (err <= bound * (1 + 2 ** -7)).all()  # (1 + 2^-7): the model dtype's own rounding of q * scale
    rel = (err.norm() / x.float().norm()).item()
    assert 0 < rel < 0.05, rel  # lossy, and by e4m3's order
    # power-of-two scales: q * scale is exact in the model dtype, so encoding again is a no-op
    assert torch.equal(round_trip_kv(got, "fp8"), got)
    assert torch.equal(round_trip_kv(x, "model"), x)


def test_fp8_kv_scale_floor_for_zero_and_denormal_tokens():
    x = torch.zeros(1, 2, 4, 8)
    x[0, 0, 1] = 1.4e-45  # a denormal token (what a decayed head held in the T case)
    x[0, 0, 2, 0] = 3.0e-39
    x[0, 1, 3] = torch.linspace(-500.0, 500.0, 8)
    scale = token_scale(x)
    assert scale[0, 0, 0] == 1.0 and scale[0, 1, 0] == 1.0  # all-zero tokens: scale 1
    assert (scale >= TINY).all() and torch.isfinite(scale).all()
    back = round_trip_kv(x, "fp8")
    assert torch.isfinite(back).all() and torch.equal(back[0, :, 0], x[0, :, 0])  # zeros stay zeros
    assert back[0, 0, 1].abs().max() <= TINY  # a denormal token rounds to (near) zero, not NaN
    big = x[0, 1, 3]
    assert ((back[0, 1, 3] - big).abs() <= big.abs() * 2 ** -4).all()  # the amax is not clipped
    assert torch.equal(back, reference_kv(x))
    empty = torch.zeros(1, 1, 5, 0)  # an MLA entry's empty values: no amax, still a defined scale
    assert round_trip_kv(empty, "fp8").shape == empty.shape


def test_fp8t_stores_T_in_fp8_and_S_in_bf16(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(1, 4, 16, 8, generator=g) * torch.logspace(-2, 2, 4)[None, :, None, None]
    T, S = encode("t", x, "fp8t", "T"), encode("s", x, "fp8t", "S")
    assert T["t"].dtype == FP8 and torch.equal(T["t.scale"], head_scale(x))  # fp8's per-head scales
    assert S["s"].dtype == torch.bfloat16 and "s.scale" not in S
    # the plain references: fp8 T exactly as the fp8 format stores it, S exactly as bf16 does
    assert torch.equal(round_trip(x, "fp8t", "T"), round_trip(x, "fp8", "T"))
    assert torch.equal(round_trip(x, "fp8t", "S"), x.to(torch.bfloat16).float())
    assert torch.equal(round_trip(x, "fp8t", "S"), round_trip(x, "bf16", "S"))
    rel_T = ((round_trip(x, "fp8t", "T") - x).norm() / x.norm()).item()
    rel_S = ((round_trip(x, "fp8t", "S") - x).norm() / x.norm()).item()
    assert 0 < rel_S < 2 ** -8 < rel_T < 0.05, (rel_S, rel_T)
    with pytest.raises(ValueError, match="does not store"):  # an fp8 S under an fp8t header
        decode(encode("s", x, "fp8", "S"), "s", "fp8t", "S")
    with pytest.raises(ValueError, match="does not store"):  # a bf16 T under an fp8t header
        decode(encode("t", x, "bf16", "T"), "t", "fp8t", "T")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny("qwen3_next", tmp_path_factory.mktemp("qn"), seed=5, **PIC_CONFIGS["qwen3_next"])
    return HybridEngine.from_pretrained(path, dtype=torch.float32)


def _entry(engine, seed: int, fmt: str) -> SegmentEntry:
    ids = torch.randint(0, engine.vocab_size, (14,), generator=torch.Generator().manual_seed(seed)).tolist()
    return engine.build_entry(ids, 4).with_format(fmt)


def _rewritten(data: bytes, edit) -> bytes:
    """data with its header JSON edited (padded so the payload stays 8-aligned) and the digest redone."""
    n = struct.unpack("<I", data[4:8])[0]
    hb = json.dumps(edit(json.loads(data[8:8 + n])), sort_keys=True, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)
    body = data[:4] + struct.pack("<I", len(hb)) + hb + data[8 + n:-DIGEST_BYTES]
    return body + checksum(body)


def test_fp8_entries_store_kv_in_fp8_and_fp8t_entries_do_not(engine, fresh_seed):
    e8, e8t = _entry(engine, fresh_seed, "fp8"), _entry(engine, fresh_seed, "fp8t")
    h8, h8t = header_of(e8.to_bytes()), header_of(e8t.to_bytes())
    assert (h8["version"], h8["kv"]) == (5, "fp8") and (h8t["version"], "kv" in h8t) == (3, False)
    t8, t8t = e8._tensors(), e8t._tensors()
    attn = [i for i, b in enumerate(e8.layers) if isinstance(b, AttentionBody)]
    assert attn and all(t8[f"{i}.k"].dtype == FP8 and t8t[f"{i}.k"].dtype == torch.float32 for i in attn)
    back = SegmentEntry.from_bytes(e8.to_bytes())
    for i in attn:  # widened to the model dtype, exactly what the builder composes with
        assert back.layers[i].keys.dtype == torch.float32
        assert torch.equal(back.layers[i].keys, e8.layers[i].keys)
        assert torch.equal(back.layers[i].values, e8.layers[i].values)
    assert e8.nbytes() < e8t.nbytes()


def test_inconsistent_kv_headers_are_clean_errors(engine, fresh_seed):
    data = _entry(engine, fresh_seed, "fp8").to_bytes()
    assert SegmentEntry.from_bytes(_rewritten(data, lambda h: h)).format == "fp8"  # the edit alone is harmless
    with pytest.raises(EntryError, match="unknown K/V encoding"):
        SegmentEntry.from_bytes(_rewritten(data, lambda h: {**h, "kv": "fp4"}))
    with pytest.raises(EntryError, match="model dtype"):  # fp8 tensors read as model-dtype K/V
        SegmentEntry.from_bytes(_rewritten(data, lambda h: {**h, "version": 4}))
    old = (Path(__file__).parent / "old_entries" / "fp8.hype").read_bytes()  # K/V in the model dtype
    assert header_of(old)["version"] == 3 and SegmentEntry.from_bytes(old).format == "fp8"
    with pytest.raises(EntryError, match="does not store"):  # model-dtype K/V under "kv": "fp8"
        SegmentEntry.from_bytes(_rewritten(old, lambda h: {**h, "version": 5, "kv": "fp8"}))
