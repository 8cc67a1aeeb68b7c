"""Entries placed on the engine's device (common.engine.pic.placement, issue 25 item 1).

The operand test records every tensor handed to any torch function (TorchFunctionMode) while a
placed run of entries is composed, its seams recomputed, the query folded in and a token
decoded, for every supported architecture's tiny config: every operand must be on
engine.device, and the operands (device, dtype, call by call) must be exactly those of entries
parsed straight into the model's dtype. What makes it able to fail on CPU: the entries are first moved to float64 (as a payload parsed into
another dtype would be, and as CPU entries would be "elsewhere" for a CUDA engine): unplaced,
float64 operands reach the model (the test below asserts that too); placed, none do. The
placement itself is checked onto a second device type CPU torch has ("meta")."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry
from common.engine.pic.placement import SUMMARY_DTYPE, entry_placement, place_entry, place_for_engine
from common.engine.pic.reuse import compose_and_query, compose_run, without_arenas
from tests.support.tiny import PIC_CONFIGS, save_tiny

MODEL_DTYPE = torch.bfloat16  # differs from the summaries' fp32, so a mixed-up placement shows


class OperandRecorder(TorchFunctionMode):
    """(function name, device, dtype) of every tensor argument of every torch call."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.device, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((getattr(func, "__name__", str(func)), t.device, t.dtype))
        return func(*args, **kwargs)


@pytest.fixture(scope="module", params=sorted(PIC_CONFIGS))
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=5, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path, dtype=MODEL_DTYPE)


def _segments(engine, seed: int):
    g = torch.Generator().manual_seed(seed)
    # lengths around the seam and the conv kernel: short bodies, warm-up tokens, long bodies
    lengths = [11, 3, 17]
    return [torch.randint(0, engine.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _parsed_elsewhere(engine, segments, seam: int) -> list[SegmentEntry]:
    """Entries through bytes, every tensor then moved to float64: what placement must undo."""
    out = []
    for ids in segments:
        e = SegmentEntry.from_bytes(engine.build_entry(ids, seam).to_bytes())
        out.append(place_entry(e, "cpu", torch.float64))
        out[-1].layers = [_all_f64(b) for b in out[-1].layers]
    return out


def _all_f64(b):
    if isinstance(b, LinearBody):
        f = lambda t: None if t is None else t.double()  # noqa: E731
        return LinearBody(f(b.T), b.form, f(b.S), f(b.conv_tail), f(b.warmup_inputs))
    if isinstance(b, AttentionBody):
        return AttentionBody(b.keys.double(), b.values.double())
    return b


def _run_recorded(engine, entries, query):
    """Compose a run, then a second run with the query folded in, then decode one token."""
    rec = OperandRecorder()
    with rec, torch.inference_mode():
        state = without_arenas(compose_run(engine, engine.new_state(), entries[:1]))
        logits, state = compose_and_query(engine, state, entries[1:], query)
        _, state = engine.decode_step(int(logits.argmax()), state)
    return rec.seen


def test_placed_entries_meet_the_model_on_its_device_and_dtypes(engine, fresh_seed):
    """Placed, entries parsed "elsewhere" (float64) give exactly the operands (every torch call's
    tensors: device and dtype, in order) of entries parsed straight into the model's dtype, all
    on engine.device. (The kernels' own float64 scratch shows up in both runs alike.)"""
    segments = _segments(engine, fresh_seed)
    entries = [place_for_engine(e, engine) for e in _parsed_elsewhere(engine, segments, seam=2)]
    seen = _run_recorded(engine, entries, query=[1, 2, 3])
    assert len(seen) > 100  # the recorder saw the model's ops
    wrong_device = {(f, d) for f, d, _ in seen if d != engine.device}
    assert not wrong_device, f"operands off {engine.device}: {sorted(map(str, wrong_device))[:8]}"
    clean = [SegmentEntry.from_bytes(engine.build_entry(ids, 2).to_bytes()) for ids in segments]
    want = _run_recorded(engine, clean, query=[1, 2, 3])
    diff = Counter(seen) - Counter(want), Counter(want) - Counter(seen)
    assert seen == want, f"operands differ: extra {dict(diff[0])}, missing {dict(diff[1])}"
    assert MODEL_DTYPE in {dt for _, _, dt in seen}


def test_unplaced_entries_do_reach_the_model_in_another_dtype(engine, fresh_seed):
    """The comparison can fail: without placement, the float64 entries' tensors reach the model
    (more float64 operands than the clean run has)."""
    segments = _segments(engine, fresh_seed)
    seen = _run_recorded(engine, _parsed_elsewhere(engine, segments, seam=2), query=[1, 2, 3])
    clean = [SegmentEntry.from_bytes(engine.build_entry(ids, 2).to_bytes()) for ids in segments]
    want = _run_recorded(engine, clean, query=[1, 2, 3])
    f64 = lambda rows: sum(dt == torch.float64 for _, _, dt in rows)  # noqa: E731
    assert f64(seen) > f64(want)


def test_place_entry_dtypes_and_device(engine, fresh_seed):
    """On another device (meta): T and S fp32, conv tails, warm-up inputs, keys and values in the
    model's dtype; the header is kept; the given entry is untouched."""
    entries = _parsed_elsewhere(engine, _segments(engine, fresh_seed), seam=2)
    for e in entries:
        placed = place_entry(e, "meta", MODEL_DTYPE)
        assert placed.key == e.key and placed.layout == e.layout
        rows = entry_placement(placed)
        assert rows and all(dev.type == "meta" for _, dev, _ in rows)
        for name, _, dt in rows:
            want = SUMMARY_DTYPE if name.endswith((".T", ".S")) else MODEL_DTYPE
            assert dt == want, (name, dt)
        assert all(dt == torch.float64 for _, _, dt in entry_placement(e))


def test_placement_keeps_the_entry_format(engine):
    """A placed entry still says how its linear part was stored (bf16 stays bf16)."""
    e = engine.build_entry(list(range(1, 12)), 2).with_format("bf16")
    assert place_for_engine(e, engine).format == "bf16"


def test_placement_keeps_tensors_already_in_place(engine):
    """Free where nothing moves: a CPU entry already in the model's dtype keeps its tensors."""
    e = engine.build_entry(list(range(1, 12)), 2)
    placed = place_for_engine(e, engine)
    for a, b in zip(e.layers, placed.layers):
        if isinstance(a, AttentionBody):
            assert a.keys.data_ptr() == b.keys.data_ptr()
        if isinstance(a, LinearBody):
            assert a.S.data_ptr() == b.S.data_ptr() and a.S.dtype == torch.float32
