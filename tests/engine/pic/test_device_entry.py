"""entry_from_device (the parse of an entry read by CUDA IPC, common/engine/pic/device_entry.py)
against its reference SegmentEntry.from_bytes, on random entries of every format and a tiny model of
two architectures. A CPU uint8 tensor stands in for the device buffer: the parse is device-agnostic
torch, so the same lines run on CUDA (scripts/gpu_tier.py's combine-over-IPC row)."""
from __future__ import annotations

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.compact import ENTRY_FORMATS
from common.engine.pic.device_entry import entry_from_device
from common.engine.pic.entry import AttentionBody, EntryError, LinearBody, SegmentEntry
from common.engine.pic.seal import ForgedEntry, open_sealed, seal
from kernels.linear_attn.lowrank import LowRankT
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 4
SECRET = b"device-entry-test-secret"


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=3, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path, dtype=torch.float32)


def _sealed(engine, seed: int, fmt: str) -> tuple[str, bytes]:
    ids = torch.randint(0, engine.vocab_size, (11,), generator=torch.Generator().manual_seed(seed)).tolist()
    entry = engine.build_entry(ids, SEAM).with_format(fmt)
    return entry.key, seal(entry.to_bytes(), SECRET)


def _tensors(entry: SegmentEntry) -> list[torch.Tensor | None]:
    out = []
    for b in entry.layers:
        if isinstance(b, LinearBody):  # a short span's T may be low-rank factors (LowRankT)
            T = [b.T.gamma, b.T.P, b.T.Q] if isinstance(b.T, LowRankT) else [b.T]
            out += [*T, b.S, b.conv_tail, b.warmup_inputs]
        elif isinstance(b, AttentionBody):
            out += [b.keys, b.values]
    return out


def _device_buffer(data: bytes, misalign: int) -> torch.Tensor:
    """The bytes in a uint8 tensor starting `misalign` bytes into its storage."""
    raw = torch.zeros(len(data) + misalign, dtype=torch.uint8)
    raw[misalign:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw[misalign:]


@pytest.mark.parametrize("fmt", ENTRY_FORMATS)
@pytest.mark.parametrize("misalign", [0, 1])
def test_the_device_parse_equals_the_host_parse(engine, fmt, misalign, fresh_seed):
    key, data = _sealed(engine, fresh_seed, fmt)
    want = SegmentEntry.from_bytes(open_sealed(data, key, SECRET), sealed=True)
    buf = _device_buffer(data, misalign)
    got = entry_from_device(buf, key)
    assert (got.token_ids, got.seam, got.model_fingerprint, got.dtype, got.format) == \
        (want.token_ids, want.seam, want.model_fingerprint, want.dtype, want.format)
    assert [type(b) for b in got.layers] == [type(b) for b in want.layers]
    pairs = list(zip(_tensors(got), _tensors(want)))
    assert pairs and all((g is None) == (w is None) for g, w in pairs)
    for g, w in pairs:
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    if fmt == "fp32" and misalign == 0:  # views of the buffer, not copies
        base = buf.untyped_storage().data_ptr()
        t = got.layers[[isinstance(b, LinearBody) for b in got.layers].index(True)].T
        t = t.P if isinstance(t, LowRankT) else t
        assert base <= t.data_ptr() < base + buf.numel()


def test_refusals(engine, fresh_seed):
    key, data = _sealed(engine, fresh_seed, "fp32")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with pytest.raises(ForgedEntry, match="another segment"):
        entry_from_device(buf, "0" * 64)
    with pytest.raises(ForgedEntry, match="not sealed"):
        entry_from_device(buf[:-4], key)
    bad = buf.clone()
    bad[:4] = torch.tensor(list(b"NOPE"), dtype=torch.uint8)
    with pytest.raises(EntryError, match="magic"):
        entry_from_device(bad, key)
    with pytest.raises(EntryError, match="1-D uint8"):
        entry_from_device(buf.view(torch.int8), key)
