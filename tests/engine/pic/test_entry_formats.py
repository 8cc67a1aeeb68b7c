"""Compact entry formats (common.engine.pic.compact): bf16 and fp8 T/S round trips, header and
version, fp32 entries unchanged, format mismatches refused, and reuse with compact entries close
to fp32 entries on tiny models of a matrix (Qwen3-Next) and a scalar (Nemotron-H) family."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from common.engine.checksum import DIGEST_BYTES, checksum
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.compact import ENTRY_FORMATS, FP8, decode, encode, head_scale, round_trip
from common.engine.pic.entry import AttentionBody, EntryError, EntryMismatch, LinearBody, SegmentEntry
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 4


@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 1, 16, 16), (1, 4, 33, 9)])
def test_encode_decode_error_bounds_on_random_tensors(shape, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])[None, :, None, None]
    assert torch.equal(round_trip(x, "fp32"), x)
    bf = round_trip(x, "bf16")
    assert bf.dtype == torch.float32
    assert ((bf - x).abs() <= x.abs() * 2 ** -8).all()  # bf16: 8 significant bits, round to nearest
    stored = encode("x", x, "fp8", "T")
    assert stored["x"].dtype == FP8 and tuple(stored["x.scale"].shape) == shape[:-2]
    f8 = decode(stored, "x", "fp8")
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding half of it), per-head scale: error
    # relative to the head's largest element, whatever the scale of the other heads
    assert ((f8 - x).abs() <= amax * 2 ** -4 + 1e-30).all()
    assert (f8 - x).abs().max() > 0  # it is lossy: the test measures something


def test_zero_heads_have_a_defined_scale():
    x = torch.zeros(1, 2, 4, 4)
    x[0, 1, 0, 0] = 3.0
    assert torch.equal(head_scale(x), torch.tensor([[1.0, 3.0 / 448]]))
    assert torch.equal(round_trip(x, "fp8"), x)


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=3, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path, dtype=torch.float32)


def _ids(engine, seed: int, n: int) -> list[int]:
    return torch.randint(0, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fmt", ENTRY_FORMATS)
def test_entry_round_trip_in_each_format(engine, fmt, fresh_seed):
    e32 = engine.build_entry(_ids(engine, fresh_seed, 13), SEAM)
    e = e32.with_format(fmt)
    data = e.to_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<I", data[4:8])[0]])
    has_attention = any(isinstance(b, AttentionBody) for b in e32.layers)
    # fp8 stores attention K/V in e4m3 too: version 5, "kv" says so (older readers refuse it cleanly)
    assert header["version"] == (2 if fmt == "fp32" else 5 if fmt == "fp8" and has_attention else 3)
    assert header.get("format", "fp32") == fmt and header.get("kv", "model") == e.kv_encoding
    back = SegmentEntry.from_bytes(data)
    assert back.format == fmt and back.key == e32.key
    for b, w, ref in zip(back.layers, e.layers, e32.layers):
        if isinstance(b, LinearBody):
            assert b.T.dtype == b.S.dtype == torch.float32
            assert torch.equal(b.T, w.T) and torch.equal(b.S, w.S)  # the builder sees what readers see
            if b.form != "matrix":
                assert torch.equal(b.T, ref.T)  # scalar and vector T stay fp32
        elif isinstance(b, AttentionBody):  # widened to the model dtype, exactly what the builder holds
            assert b.keys.dtype == ref.keys.dtype and torch.equal(b.keys, w.keys) and torch.equal(b.values, w.values)
            assert torch.equal(b.keys, ref.keys) == (fmt != "fp8")
    if fmt != "fp32":
        assert e.nbytes() < e32.nbytes()
    assert fmt == "fp32" or data != e32.to_bytes()


def test_fp32_entries_are_written_as_before(engine, fresh_seed):
    # dense T: a 5-token span's low-rank T is version 4 (tests/engine/pic/test_lowrank_entries.py)
    e = build_entry(engine, _ids(engine, fresh_seed, 9), SEAM, lowrank="never")
    assert e.format == "fp32" and e.with_format("fp32") is e
    data = e.to_bytes()
    assert b'"format"' not in data[:200] and struct.unpack("<I", data[4:8])[0] > 0
    assert SegmentEntry.from_bytes(data).format == "fp32"


def test_format_mismatch_is_refused(engine, fresh_seed):
    ids = _ids(engine, fresh_seed, 10)
    e = engine.build_entry(ids, SEAM).with_format("bf16")
    e.check(ids, seam=SEAM, fingerprint=engine.fingerprint, dtype=engine.dtype, entry_format="bf16")
    with pytest.raises(EntryMismatch, match="stored in bf16"):
        e.check(ids, seam=SEAM, fingerprint=engine.fingerprint, dtype=engine.dtype, entry_format="fp32")
    with pytest.raises(EntryError, match="cannot be restored"):
        e.with_format("fp32")
    with pytest.raises(ValueError, match="entry format must be"):
        e.with_format("int4")


def _resealed(data: bytes, old: bytes, new: bytes) -> bytes:
    body = data[:-DIGEST_BYTES].replace(old, new, 1)
    assert body != data[:-DIGEST_BYTES]
    return body + checksum(body)


def test_unknown_or_inconsistent_format_is_a_clean_error(engine, fresh_seed):
    data = engine.build_entry(_ids(engine, fresh_seed, 10), SEAM).with_format("bf16").to_bytes()
    with pytest.raises(EntryError, match="unknown entry format"):
        SegmentEntry.from_bytes(_resealed(data, b'"format":"bf16"', b'"format":"bf17"'))
    with pytest.raises(EntryError, match="does not store"):  # bf16 tensors under an fp8 header
        SegmentEntry.from_bytes(_resealed(data, b'"format":"bf16"', b'"format":"fp8" '))


@pytest.mark.parametrize("fmt", ["bf16", "fp8t", "fp8"])
def test_reuse_with_compact_entries_stays_close_to_fp32_entries(engine, fmt, fresh_seed):
    kls = []
    for p in range(5):
        seed = fresh_seed + 100 * p
        segs = [_ids(engine, seed + i, n) for i, n in enumerate((12, 7, 15))]
        query = _ids(engine, seed + 9, 5)
        e32 = [engine.build_entry(s, SEAM) for s in segs]
        compact = [SegmentEntry.from_bytes(e.with_format(fmt).to_bytes()) for e in e32]
        ref = engine.prefill_segments(segs, query, entries=e32, seam=SEAM).logits.double().log_softmax(-1)
        got = engine.prefill_segments(segs, query, entries=compact, seam=SEAM).logits.double().log_softmax(-1)
        kls.append((ref.exp() * (ref - got)).sum().item())
    assert all(kl >= 0 for kl in kls), kls
    # The median of 5 prompts, not each: the tiny Qwen3-Next is a mixture of experts whose random
    # router has near-ties, and any rounding of a state can flip a query token's top-k experts, a
    # jump in the logits that no format's precision bounds (measured over 800 prompts: median KL
    # 1e-7 in bf16, 3 prompts at 8e-3-5e-2, each with 4 of 16 routing choices flipped; relative
    # noise of 1e-3 on S flips them too). A broken format moves every prompt, so the median holds it.
    # fp8t at bf16's bound: on these models (Gated DeltaNet's decaying T; Mamba2's scalar T, which
    # no format compacts) its fp8 T adds next to nothing to bf16's S (bench.entry_format_error)
    assert sorted(kls)[2] < {"bf16": 1e-4, "fp8t": 1e-4, "fp8": 1e-2}[fmt], kls


def test_the_engine_builds_and_accepts_its_own_format(engine, fresh_seed):
    ids = _ids(engine, fresh_seed, 11)
    e32 = engine.build_entry(ids, SEAM)
    engine.entry_format = "fp8"
    try:
        e8 = engine.build_entry(ids, SEAM)
        assert e8.format == "fp8" and e8.key == e32.key
        engine.check_entry(e8, ids, SEAM)
        # an fp32 entry reaching a combine that serves fp8 (or the reverse) is a mismatch: rebuilt
        with pytest.raises(EntryMismatch, match="stored in fp32"):
            engine.check_entry(e32, ids, SEAM)
    finally:
        engine.entry_format = "fp32"
    with pytest.raises(EntryMismatch, match="stored in fp8"):
        engine.check_entry(e8, ids, SEAM)


def test_worker_configs_check_the_entry_format():
    from pathlib import Path

    from services.scatter.config import ScatterConfig

    assert ScatterConfig(model=Path("m")).entry_format == "bf16"  # WORKER_ENTRY_FORMAT: workers store bf16
    assert ScatterConfig(model=Path("m"), entry_format="bf16").entry_format == "bf16"
    with pytest.raises(ValueError, match="entry format must be one of"):
        ScatterConfig(model=Path("m"), entry_format="int4")
