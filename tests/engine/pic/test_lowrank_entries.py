"""Low-rank T in entries (issue 28 item 1): a delta-family layer whose cached span is short keeps T as
its factors (kernels.linear_attn.lowrank.LowRankT), flagged in the header (version 4), in every
entry format; composed, such an entry gives the dense entry's next-token logits on every tiny
delta-family architecture; the choice is automatic by bytes; entries written before it still open.

The tiny checkpoints are too forgiving for this comparison as they are: the Qwen ones decay so fast
(exp(A_log) ~ 1) that T of a few tokens is ~1e-7, and in every one the linear mixers' outputs are
so small (initializer_range 0.1) that dropping T moves the logits by ~1e-6. The engines here decay
far slower (the gate's input shifted, `_slow_decays`, as in trained models) and their linear mixers' output projections are 8x
larger, so that losing T moves the logits by 0.3-1.3 (relative) and the tolerance below means
something (asserted beside each comparison).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from common.engine.checksum import DIGEST_BYTES, checksum
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.build import build_entry
from common.engine.pic.compact import lowrank_is_smaller
from common.engine.pic.entry import AttentionBody, EntryError, LinearBody, SegmentEntry
from common.engine.pic.reference import build_entry_reference
from common.engine.pic.seal import header_of
from kernels.linear_attn import FAMILY
from kernels.linear_attn.lowrank import LowRankT
from tests.support.tiny import PIC_CONFIGS, save_tiny

DELTA_ARCHS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid"]
OLD_ENTRIES = Path(__file__).parent / "old_entries"
# Relative gap of the next-token logits (max |a - b| / max |b|), low-rank against dense fp32 entries.
# Both are exact factorisations of the same product of transitions and differ by fp32 rounding only
# (the dense T accumulates through the chunked UT transform, the factors are solved in fp64 and
# rounded once): measured <= 1e-6 over 4 layers; 2e-5 leaves a margin of 20 and stays far below
# what dropping T does (asserted > 1e-2 in the same test; measured 0.3-1.3).
LOGIT_TOL = 2e-5


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=DELTA_ARCHS)
def engine(request, tmp_path_factory):
    mt = request.param
    eng = HybridEngine.from_pretrained(save_tiny(mt, tmp_path_factory.mktemp(mt), seed=3, **PIC_CONFIGS[mt]),
                                       dtype=torch.float32)
    with torch.no_grad():
        for layer in eng.model.layers:
            if layer.kind == "linear":
                _slow_decays(layer.mixer)
                m = layer.mixer  # the output projection: Qwen out_proj, OLMo o_proj, KDA by out_proj_name
                out = getattr(m, getattr(m, "out_proj_name", "out_proj" if hasattr(m, "out_proj") else "o_proj"))
                out.weight.mul_(8.0)  # the linear layers' outputs weigh in the logits
    return eng


def _slow_decays(mixer) -> None:
    """Log-decays ~ -1e-2 a token (module docstring): the gate's input shifted by -6 (softplus(u - 6)
    ~ 2.5e-3 e^u; Ling's safe gate lower_bound * sigmoid(rate u), at rate 1, alike)."""
    if getattr(mixer, "safe_gate", False):
        mixer.A_log.zero_()
    mixer.dt_bias.sub_(6.0)


def _ids(engine, seed: int, n: int) -> list[int]:
    return torch.randint(0, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _matrix_layers(engine) -> list[int]:
    return [i for i, layer in enumerate(engine.model.layers)
            if layer.kind == "linear" and FAMILY[layer.mixer.family].delta]


def test_every_tiny_delta_architecture_is_covered():
    from bench.entry_bytes import build_meta_model

    delta = {mt for mt, cfg in PIC_CONFIGS.items()
             if any(layer.kind == "linear" and FAMILY[layer.mixer.family].delta
                    for layer in build_meta_model(mt, cfg).layers)}
    assert delta == set(DELTA_ARCHS)


def _without_T(entry: SegmentEntry) -> SegmentEntry:
    """The entry with every low-rank T replaced by zero (what a composition that lost T sees)."""
    layers = [LinearBody(LowRankT(*(torch.zeros_like(t) for t in (b.T.gamma, b.T.P, b.T.Q))), b.form, b.S,
                         b.conv_tail, b.warmup_inputs) if isinstance(b, LinearBody) and isinstance(b.T, LowRankT)
              else b for b in entry.layers]
    return SegmentEntry(entry.token_ids, entry.seam, entry.model_fingerprint, entry.dtype, layers, entry.format)


@pytest.mark.parametrize("seam,order", [(2, "segment"), (5, "layer"), (0, "layer")])
def test_lowrank_entries_give_the_dense_entries_logits(engine, fresh_seed, seam, order):
    lengths = [seam + 4 + fresh_seed % 7, seam + 4 + fresh_seed % 5, seam + 9 + fresh_seed % 3]  # spans of 1..11
    segs = [_ids(engine, fresh_seed + i, n) for i, n in enumerate(lengths)]
    query = _ids(engine, fresh_seed + 9, 5)
    dense = [build_entry(engine, s, seam, lowrank="never") for s in segs]
    low = [SegmentEntry.from_bytes(build_entry(engine, s, seam, lowrank="always").to_bytes()) for s in segs]
    for d, e in zip(dense, low):
        assert d.lowrank_layers == [] and e.lowrank_layers == _matrix_layers(engine)
        for i in e.lowrank_layers:
            assert rel(e.layers[i].T.dense(), d.layers[i].T) < 1e-5
            assert rel(e.layers[i].S, d.layers[i].S) < 1e-5
    ref = engine.prefill_segments(segs, query, entries=dense, seam=seam, order=order).logits
    got = engine.prefill_segments(segs, query, entries=low, seam=seam, order=order).logits
    assert rel(got, ref) < LOGIT_TOL
    lost = engine.prefill_segments(segs, query, entries=[_without_T(e) for e in low], seam=seam, order=order).logits
    assert rel(lost, ref) > 1e-2  # T matters to these logits: the comparison above could fail


@pytest.mark.parametrize("mix", ["factored", "mixed"])
def test_a_run_with_factored_bodies_is_composed_in_one_call_per_layer(engine, fresh_seed, monkeypatch, mix):
    """The layer-major pass composes a run in one kernels.compose.compose_run_states call per linear
    layer (one Triton launch on CUDA) whether its bodies hold T as factors, or some do and some do
    not, and gives the dense entries' logits."""
    import common.engine.pic.seam_plan as seam_plan

    calls, real = [], seam_plan.compose_run_states

    def spy(Ta, Sa, Tb, Sb, *args, **kwargs):
        calls.append((isinstance(Tb, LowRankT), Sa.shape[0]))
        return real(Ta, Sa, Tb, Sb, *args, **kwargs)

    monkeypatch.setattr(seam_plan, "compose_run_states", spy)
    seam = 3
    lengths = [seam + 5 + fresh_seed % 7, seam + 4, seam + 9 + fresh_seed % 3, seam + 6]
    segs = [_ids(engine, fresh_seed + i, n) for i, n in enumerate(lengths)]
    query = _ids(engine, fresh_seed + 9, 4)
    dense = [build_entry(engine, s, seam, lowrank="never") for s in segs]
    low = [build_entry(engine, s, seam, lowrank="always" if mix == "factored" or j % 2 == 0 else "never")
           for j, s in enumerate(segs)]
    ref = engine.prefill_segments(segs, query, entries=dense, seam=seam, order="layer").logits
    calls.clear()
    got = engine.prefill_segments(segs, query, entries=low, seam=seam, order="layer").logits
    linear = [i for i, layer in enumerate(engine.model.layers) if layer.kind == "linear"]
    assert len(calls) == len(linear) and all(n == len(segs) for _, n in calls)
    assert sum(factored for factored, _ in calls) == (len(_matrix_layers(engine)) if mix == "factored" else 0)
    assert rel(got, ref) < LOGIT_TOL


def test_the_fused_build_equals_the_reference_in_lowrank_form(engine, fresh_seed):
    ids = _ids(engine, fresh_seed, 9)
    got, ref = build_entry(engine, ids, 3), build_entry_reference(engine, ids, 3)
    assert got.lowrank_layers == _matrix_layers(engine)  # 6 cached tokens, K >= 16: automatic
    for i in got.lowrank_layers:
        assert rel(got.layers[i].T.dense(), ref.layers[i].T) < 1e-5 and rel(got.layers[i].S, ref.layers[i].S) < 1e-5


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_lowrank_entries_in_each_format(engine, fmt, fresh_seed):
    kls = [_lowrank_prompt_kl(engine, fmt, fresh_seed + 100 * p) for p in range(5)]
    assert all(kl >= -1e-9 for kl in kls), kls
    # the median of 5 prompts, with the bounds of test_entry_formats and for its reason: a mixture of
    # experts' router (Qwen3-Next, Kimi, Ling) flips a top-k choice at a near-tie now and then, which
    # no precision bounds; a wrong format moves every prompt
    assert sorted(kls)[2] < {"fp32": 1e-9, "bf16": 1e-4, "fp8": 1e-2}[fmt], kls


def _lowrank_prompt_kl(engine, fmt: str, seed: int) -> float:
    """KL(dense fp32 entries || low-rank entries in `fmt`) at one prompt's query, after checking
    the low-rank entries' bytes and that the builder composes with what readers see."""
    segs = [_ids(engine, seed + i, n) for i, n in enumerate((7, 9, 6))]
    query = _ids(engine, seed + 9, 5)
    seam = 2
    e32 = [build_entry(engine, s, seam, lowrank="never") for s in segs]
    low = [build_entry(engine, s, seam, lowrank="always").with_format(fmt) for s in segs]
    back = [SegmentEntry.from_bytes(e.to_bytes()) for e in low]
    for b, w in zip(back, low):
        assert b.format == fmt and b.lowrank_layers == w.lowrank_layers == _matrix_layers(engine)
        for i in b.lowrank_layers:  # the builder composes with exactly what readers see
            got, want = b.layers[i].T, w.layers[i].T
            assert all(torch.equal(x, y) and x.dtype == torch.float32
                       for x, y in zip((got.gamma, got.P, got.Q), (want.gamma, want.P, want.Q)))
    # smaller than the dense entry in the same format where the automatic choice takes it
    for s, e in zip(segs, low):
        d = build_entry(engine, s, seam, lowrank="never").with_format(fmt)
        K = d.layers[_matrix_layers(engine)[0]].T.shape[-1]
        if lowrank_is_smaller(len(s) - 3, K, fmt):  # the span: after the conv warm-up of 3 tokens
            assert e.nbytes() < d.nbytes()
    ref = engine.prefill_segments(segs, query, entries=e32, seam=seam).logits.double().log_softmax(-1)
    got = engine.prefill_segments(segs, query, entries=back, seam=seam).logits.double().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum().item()


def test_the_choice_is_automatic_by_bytes(engine, fresh_seed):
    layers = _matrix_layers(engine)
    K = engine.model.layers[layers[0]].mixer.features(torch.zeros(1, 1, engine.model.embed_tokens.weight.shape[1]),
                                                     None)[1].shape[-1]
    seam = 4
    for span in (1, (K - 1) // 2, K // 2, K + 3):
        ids = _ids(engine, fresh_seed + span, seam + span)
        e = build_entry(engine, ids, seam)
        assert e.lowrank_layers == (layers if lowrank_is_smaller(span, K, "fp32") else []), span
        other = build_entry(engine, ids, seam, lowrank="never" if e.lowrank_layers else "always")
        assert e.nbytes() <= other.nbytes()
    assert lowrank_is_smaller((K - 1) // 2, K, "fp32") and not lowrank_is_smaller(K // 2, K, "fp32")


def test_header_flags_the_lowrank_layers(engine, fresh_seed):
    e = build_entry(engine, _ids(engine, fresh_seed, 8), 2, lowrank="always").with_format("bf16")
    data = e.to_bytes()
    n = struct.unpack("<I", data[4:8])[0]
    header = json.loads(data[8 : 8 + n])
    assert header["version"] == 4 and header["format"] == "bf16" and header["lowrank"] == _matrix_layers(engine)
    assert all(header["layers"][i] == "linear:matrix" for i in header["lowrank"])  # the layout check is unchanged
    fp32 = build_entry(engine, _ids(engine, fresh_seed, 8), 2, lowrank="always").to_bytes()
    assert json.loads(fp32[8 : 8 + struct.unpack("<I", fp32[4:8])[0]])["format"] == "fp32"


def _rewritten(data: bytes, header_edit) -> bytes:
    """data with its header JSON edited (padded so the payload stays 8-aligned) and the digest redone."""
    n = struct.unpack("<I", data[4:8])[0]
    header = header_edit(json.loads(data[8 : 8 + n]))
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)
    body = data[:4] + struct.pack("<I", len(hb)) + hb + data[8 + n : -DIGEST_BYTES]
    return body + checksum(body)


def test_a_wrong_lowrank_flag_is_a_clean_error(engine, fresh_seed):
    data = build_entry(engine, _ids(engine, fresh_seed, 8), 2, lowrank="always").to_bytes()
    attention = next(i for i, layer in enumerate(engine.model.layers) if layer.kind == "attention")
    first = _matrix_layers(engine)[0]
    for edit in (lambda h: {**h, "lowrank": h["lowrank"] + [attention]},  # an attention layer
                 lambda h: {**h, "lowrank": h["lowrank"][1:]},  # a low-rank layer read as dense: no "T"
                 lambda h: {**h, "lowrank": [99]},
                 lambda h: {**h, "lowrank": "all"},
                 lambda h: {**h, "version": 6}):
        with pytest.raises(EntryError):
            SegmentEntry.from_bytes(_rewritten(data, edit))
    assert SegmentEntry.from_bytes(_rewritten(data, lambda h: h)).lowrank_layers[0] == first


def synthetic_entry() -> SegmentEntry:
    """The entry whose bytes old_entries/ holds, written by the code before low-rank T (c7b1ba4)."""
    g = torch.Generator().manual_seed(28)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layers = [
        LinearBody(T=r(1, 2, 8, 8), form="matrix", S=r(1, 2, 8, 4), conv_tail=r(1, 6, 3), warmup_inputs=None),
        AttentionBody(r(1, 2, 5, 8), r(1, 2, 5, 8)),
        LinearBody(T=r(1, 2).sigmoid(), form="scalar", S=r(1, 2, 8, 4), conv_tail=None, warmup_inputs=r(1, 2, 16)),
        None,
    ]
    return SegmentEntry(list(range(7, 14)), 2, "f" * 64, "float32", layers)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_entries_written_before_lowrank_still_open(fmt):
    old = (OLD_ENTRIES / f"{fmt}.hype").read_bytes()
    want = synthetic_entry().with_format(fmt)
    e = SegmentEntry.from_bytes(old)
    assert e.format == fmt and e.lowrank_layers == [] and e.key == want.key
    a, b = e._tensors(), want._tensors()
    assert a.keys() == b.keys()
    linear = [k for k in a if not k.endswith((".k", ".v", ".k.scale", ".v.scale"))]
    assert all(torch.equal(a[k], b[k]) for k in linear)
    # keys and values: every format kept them in the model dtype before version 5, and they open so
    raw = synthetic_entry().layers[1]
    assert torch.equal(e.layers[1].keys, raw.keys) and torch.equal(e.layers[1].values, raw.values)
    if fmt != "fp8":
        assert want.to_bytes() == old  # and dense entries are still written byte for byte as before
    else:  # fp8 now stores them in e4m3 too: a version-5 entry, which readers before it refuse
        new = want.to_bytes()
        assert header_of(new)["version"] == 5 and header_of(new)["kv"] == "fp8" and len(new) < len(old)
