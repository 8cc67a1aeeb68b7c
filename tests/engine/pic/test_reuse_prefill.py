"""Reuse prefill (common.engine.pic): exactness invariants, fidelity, decode, bad input.

Runs on tiny random checkpoints of every architecture the engine serves (tests/support/tiny.py)."""
import subprocess
import sys

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import EntryError, EntryMismatch, SegmentEntry, segment_key
from tests.support.tiny import PIC_CONFIGS, save_tiny


def kl(p_logits, q_logits) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


@pytest.fixture(scope="module", params=sorted(PIC_CONFIGS))
def engine(request, tmp_path_factory):
    mt = request.param
    path = save_tiny(mt, tmp_path_factory.mktemp(mt), seed=21, **PIC_CONFIGS[mt])
    return HybridEngine.from_pretrained(path)


def random_prompt(eng, seed, lengths, qlen=7):
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, eng.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return segs, torch.randint(0, eng.vocab_size, (qlen,), generator=g).tolist()


LENGTHS = (40, 2, 33, 17, 5, 60, 9, 25)  # odd sizes, one shorter than the conv kernel


def test_one_segment_is_exact(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, (50,))
    full = engine.prefill_segments(segs, q, mode="full").logits
    for w in (0, 3, 8):
        hyp = engine.prefill_segments(segs, q, mode="hypic", seam=w).logits
        assert (hyp - full).abs().max() < 1e-4, w


def test_seam_covering_every_segment_is_exact(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    full = engine.prefill_segments(segs, q, mode="full").logits
    for order in ("segment", "layer"):
        hyp = engine.prefill_segments(segs, q, mode="hypic", seam=max(LENGTHS), order=order).logits
        assert (hyp - full).abs().max() < 1e-4, order


def test_layer_major_equals_segment_major(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    for w in (0, 2, 8):
        a = engine.prefill_segments(segs, q, mode="hypic", seam=w, order="segment")
        b = engine.prefill_segments(segs, q, mode="hypic", seam=w, order="layer")
        assert (a.logits - b.logits).abs().max() < 1e-4, w
        # and the states they leave behind continue identically
        ta = engine.generate(a, max_new_tokens=4)
        tb = engine.generate(b, max_new_tokens=4)
        assert ta == tb


def test_prefix_mode_equals_full_when_it_reuses(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    engine.prefix_cache.clear()
    full = engine.prefill_segments(segs, q, mode="full").logits
    cold = engine.prefill_segments(segs[:5], q, mode="prefix")  # segments and query in one pass
    assert cold.extra["reused_segments"] == 0 and len(engine.prefix_cache) == 5
    assert (cold.logits - engine.prefill_segments(segs[:5], q, mode="full").logits).abs().max() < 1e-4
    assert cold.state.seq_len == sum(map(len, segs[:5])) + len(q)
    out = engine.prefill_segments(segs, [9, 8, 7], mode="prefix")
    assert out.extra["reused_segments"] == 5
    out = engine.prefill_segments(segs, q, mode="prefix")
    assert out.extra["reused_segments"] == len(segs)
    assert (out.logits - full).abs().max() < 1e-4


@pytest.mark.parametrize("lengths", [(13, 2, 31, 5, 20), (2, 2, 40, 3)])
def test_one_pass_over_segments_equals_a_forward_per_segment(engine, fresh_seed, lengths):
    """The prefix baseline's single pass (common.engine.pic.prefix.forward_segments) leaves, at every
    segment end, the state a forward per segment leaves -- from the start and after a prefix (the
    second prompt: ends within the conv's first k - 1 tokens, whose tail takes the incoming one's).
    No segment is one token long: a one-token forward from a state is a decode step, which for
    Mamba2 leaves dt unclamped where every prefill (this pass, full recompute) clamps it."""
    from common.engine.pic.prefix import forward_segments
    from common.engine.state import AttentionLayerState, LinearLayerState

    segs, _ = random_prompt(engine, fresh_seed, lengths)
    for before in (None, engine.forward(segs[0])[2]):
        rest = segs[1:] if before is not None else segs
        got = forward_segments(engine, rest, before)
        state = before
        for j, seg in enumerate(rest):
            _, _, state = engine.forward(seg, state)
            assert got[j].seq_len == state.seq_len
            for a, b in zip(got[j].layers, state.layers):
                assert type(a) is type(b)
                if isinstance(b, LinearLayerState):
                    pairs = [(a.recurrent, b.recurrent), (a.conv, b.conv)]
                elif isinstance(b, AttentionLayerState):
                    pairs = [(a.keys, b.keys), (a.values, b.values)]
                else:
                    pairs = []
                for x, y in pairs:
                    if y is None:  # no conv (MiniMax's lightning attention)
                        assert x is None
                        continue
                    assert x.shape == y.shape
                    if y.numel():  # MLA latents keep zero-width values
                        # norm-relative, as every state comparison here (tests/engine/pic/test_compose_runs.py):
                        # a largest-element bound failed on round-off, 2.9e-5 at |y| 1.9 (seed 226413552)
                        err = (x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)
                        assert err <= 1e-5, (j, float(err))


def test_entry_bytes_are_deterministic_and_round_trip(engine, fresh_seed, tmp_path):
    segs, _ = random_prompt(engine, fresh_seed, (37,))
    a = engine.build_entry(segs[0], seam=4).to_bytes()
    b = engine.build_entry(segs[0], seam=4).to_bytes()
    assert a == b
    e = SegmentEntry.from_bytes(a)
    assert e.to_bytes() == a
    assert e.key == segment_key(engine.fingerprint, 4, engine.dtype, segs[0])
    # corrupted payload -> refused, never used
    bad = bytearray(a)
    bad[-10] ^= 0xFF
    with pytest.raises(EntryError, match="checksum"):
        SegmentEntry.from_bytes(bytes(bad))


def test_entry_parse_views_the_buffer_and_matches_safetensors(engine, fresh_seed):
    """from_bytes views a writable buffer (no copy) and gives exactly what safetensors' own
    (copying) loader gives; entries of format version 1 (blake2b, unaligned payload) still parse."""
    import hashlib
    import json
    import struct

    import numpy as np
    from safetensors.torch import load as st_load

    segs, _ = random_prompt(engine, fresh_seed, (29,))
    data = engine.build_entry(segs[0], seam=3).to_bytes()
    (n,) = struct.unpack("<I", data[4:8])
    assert (8 + n) % 8 == 0  # payload aligned
    ref = st_load(data[8 + n:-16])
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    e = SegmentEntry.from_bytes(buf)
    lo, hi = buf.ctypes.data, buf.ctypes.data + buf.nbytes
    views = [t for t in e._tensors().values() if t.numel()]
    assert views and all(lo <= t.data_ptr() < hi for t in views)  # aliases the buffer
    for k, t in e._tensors().items():
        assert torch.equal(t, ref[k]), k
    # version 1: blake2b hex digest, no padding (the payload may start misaligned)
    header = json.loads(data[8:8 + n])
    payload = data[8 + n:-16]
    header.update(version=1, checksum=hashlib.blake2b(payload, digest_size=16).hexdigest())
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b" "  # payload off by one
    old = b"HYPE" + struct.pack("<I", len(hb)) + hb + payload
    e1 = SegmentEntry.from_bytes(bytearray(old))
    assert e1.to_bytes() == data
    # every byte is covered: a flip in the header is refused as surely as one in a tensor
    for at in (9, 8 + n + 20, len(data) - 30, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(EntryError):
            SegmentEntry.from_bytes(bad)


@pytest.mark.parametrize("length,seam", [(37, 4), (2, 8), (60, 0), (9, 8), (3, 1), (71, 16)])
def test_fused_build_equals_the_reference_build(engine, fresh_seed, length, seam):
    """build_entry (T from the forward's own fused kernel) against build_entry_reference (plain
    forward, then features and summary again): same tensors up to float32 round-off (the fused
    kernel orders the sums differently, and S(C|0) is recovered as end - T . start)."""
    from common.engine.pic.build import build_entry
    from common.engine.pic.reference import build_entry_reference

    segs, _ = random_prompt(engine, fresh_seed, (length,))
    # dense T on both sides (a short span's automatic low-rank T: tests/engine/pic/test_lowrank_entries.py)
    got = build_entry(engine, segs[0], seam, lowrank="never").__dict__
    ref = build_entry_reference(engine, segs[0], seam).__dict__
    a, b = SegmentEntry(**got)._tensors(), SegmentEntry(**ref)._tensors()
    assert a.keys() == b.keys() and [type(x) for x in got["layers"]] == [type(x) for x in ref["layers"]]
    assert [getattr(x, "form", None) for x in got["layers"]] == [getattr(x, "form", None) for x in ref["layers"]]
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if a[k].numel():
            assert (a[k] - b[k]).abs().max() <= 1e-5 * max(1.0, b[k].abs().max()), k


@pytest.mark.processes
def test_entry_is_identical_in_another_process(tmp_path):
    """Build the same entry in two fresh processes: byte-identical (hence cacheable anywhere)."""
    path = save_tiny("qwen3_5_text", tmp_path / "m", seed=3, **PIC_CONFIGS["qwen3_5_text"])
    code = (
        "import sys; sys.path.insert(0, '.'); import hashlib; from common.engine.hybrid_engine import HybridEngine;"
        f"e = HybridEngine.from_pretrained({str(path)!r}).build_entry(list(range(1, 60)), seam=8);"
        "print(hashlib.sha256(e.to_bytes()).hexdigest())"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    eng = HybridEngine.from_pretrained(path)
    import hashlib

    outs.add(hashlib.sha256(eng.build_entry(list(range(1, 60)), seam=8).to_bytes()).hexdigest() + "\n")
    assert len(outs) == 1


@pytest.mark.slow  # a full fidelity report per architecture: the longest in-process test
def test_fidelity_report_hypic_beats_additive(engine, fresh_seed):
    """KL(full || mode) and top-1 agreement on 8-segment prompts; hypic beats the additive ablation."""
    rows = {}
    prompts = [random_prompt(engine, fresh_seed + i, LENGTHS) for i in range(3)]
    for name, kwargs in [("additive", dict(mode="additive"))] + [
        (f"hypic w={w}", dict(mode="hypic", seam=w)) for w in (0, 2, 4, 8, 16, 32)
    ]:
        kls, agree = [], []
        for segs, q in prompts:
            full = engine.prefill_segments(segs, q, mode="full").logits
            out = engine.prefill_segments(segs, q, **kwargs).logits
            kls.append(kl(full, out))
            agree.append(float(full.argmax() == out.argmax()))
        rows[name] = (sum(kls) / len(kls), sum(agree) / len(agree))
    print(f"\n{engine.model_type}: " + "  ".join(f"{k}: KL={v[0]:.2e} top1={v[1]:.2f}" for k, v in rows.items()))
    # w=0 differs from additive only by T (and the conv patch): with a random model's fast decays T
    # can be ~0 and the two nearly tie, so the assertion is on the default seam.
    assert rows["hypic w=8"][0] < rows["additive"][0]


def test_naive_is_the_old_name_of_additive(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    new = engine.prefill_segments(segs, q, mode="additive")
    old = engine.prefill_segments(segs, q, mode="naive", entries=new.extra["entries"])
    assert old.extra["mode"] == new.extra["mode"] == "additive"
    assert old.extra["built"] == [] and all(e.seam == 0 for e in new.extra["entries"])
    assert torch.equal(old.logits, new.logits)
    hyp = engine.prefill_segments(segs, q, mode="hypic", seam=0).logits
    assert not torch.equal(hyp, new.logits)  # the ablation is not hypic w=0 (no T)


def test_decode_after_hypic(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    full = engine.prefill_segments(segs, q, mode="full")
    hyp = engine.prefill_segments(segs, q, mode="hypic", seam=max(LENGTHS))
    assert engine.generate(hyp, max_new_tokens=32) == engine.generate(full, max_new_tokens=32)
    # with a real seam it still decodes 32 tokens from the composed state
    out = engine.generate(engine.prefill_segments(segs, q, mode="hypic", seam=8), max_new_tokens=32)
    assert len(out) == 32 and all(0 <= t < engine.vocab_size for t in out)


def test_entries_given_equal_entries_built(engine, fresh_seed):
    segs, q = random_prompt(engine, fresh_seed, LENGTHS)
    first = engine.prefill_segments(segs, q, mode="hypic", seam=4)
    assert first.extra["built"] == list(range(len(segs)))
    entries = [SegmentEntry.from_bytes(e.to_bytes()) for e in first.extra["entries"]]
    again = engine.prefill_segments(segs, q, entries=entries, mode="hypic", seam=4)
    assert again.extra["built"] == []
    assert torch.equal(first.logits, again.logits)


def test_bad_input(engine, tmp_path):
    segs, q = random_prompt(engine, 1, (12, 9))
    engine.prefix_cache.clear()
    with pytest.raises(ValueError, match="no segments"):
        engine.prefill_segments([], q)
    with pytest.raises(ValueError, match="segment 1 is empty"):
        engine.prefill_segments([segs[0], []], q)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prefill_segments([segs[0], [engine.vocab_size]], q)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prefill_segments(segs, [engine.vocab_size + 5], mode="prefix")
    assert len(engine.prefix_cache) == 0  # nothing cached by a refused request
    good = engine.build_entry(segs[0], seam=8)
    other_seam = engine.build_entry(segs[0], seam=4)
    with pytest.raises(EntryError, match="seam"):
        engine.prefill_segments(segs, q, entries=[other_seam, None], seam=8)
    other_model = SegmentEntry.from_bytes(good.to_bytes())
    other_model.model_fingerprint = "0" * 32
    with pytest.raises(EntryError, match="another model"):
        engine.prefill_segments(segs, q, entries=[other_model, None], seam=8)
    other_dtype = SegmentEntry.from_bytes(good.to_bytes())
    other_dtype.dtype = "bfloat16"
    with pytest.raises(EntryError, match="bfloat16"):
        engine.prefill_segments(segs, q, entries=[other_dtype, None], seam=8)
    with pytest.raises(EntryError, match="other tokens"):
        engine.prefill_segments(segs[::-1], q, entries=[good, None], seam=8)
    other_layout = SegmentEntry.from_bytes(good.to_bytes())
    other_layout.layers = other_layout.layers[::-1]
    with pytest.raises(EntryError, match="layers"):
        engine.prefill_segments(segs, q, entries=[other_layout, None], seam=8)


def test_entry_check_is_the_one_rule(engine):
    """SegmentEntry.check (what pic and the services call) names each mismatch; a fitting entry passes."""
    segs, _ = random_prompt(engine, 3, (14,))
    entry = engine.build_entry(segs[0], seam=4)
    fits = dict(seam=4, fingerprint=engine.fingerprint, dtype=engine.dtype, layout=engine.entry_layout)
    entry.check(segs[0], **fits)
    engine.check_entry(entry, segs[0], 4)
    assert entry.layout == engine.entry_layout
    assert {k.split(":")[0] for k in entry.layout} <= {"linear", "attention", "none"}
    cases = {"another model": dict(fits, fingerprint="f" * 32), "seam 4": dict(fits, seam=0),
             "float32, the request uses bfloat16": dict(fits, dtype="bfloat16"),
             "do not fit": dict(fits, layout=["none"] * len(entry.layers))}
    for message, kwargs in cases.items():
        with pytest.raises(EntryMismatch, match=message):
            entry.check(segs[0], **kwargs)
    with pytest.raises(EntryMismatch, match="other tokens"):
        entry.check(segs[0][:-1], **fits)
    with pytest.raises(EntryMismatch, match="seam 4, the request uses 0"):
        engine.check_entry(entry, segs[0], 0)
