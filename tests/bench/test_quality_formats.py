"""The quality evaluation at each entry storage format (bench.quality.formats, issue 28 item 3): a
format mode goes through the mesh's path (build at the format, bytes, the combine's check), fp32
through that path is eval's hypic exactly, and the paired figures count what the prompts did."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "hypic-tiny-qwen35"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="bundled model missing")


@pytest.fixture(scope="module")
def engine():
    from bench.quality import eval as E

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield E.load_engine(MODEL)
    torch.set_num_threads(n)


def test_format_modes_pair_with_fp32_entries(engine):
    from bench.quality import eval as E

    modes = ("full", "hypic_w8", "hypic_w8@fp32", "hypic_w8@bf16")
    segments, query, answer = E.prompt_ids(engine, "update", 1)
    res = E.run_prompt(engine, segments, query, answer, modes)
    # fp32 entries through bytes and the combine's check compose exactly what eval's hypic does
    assert res["hypic_w8@fp32"]["pred"] == res["hypic_w8"]["pred"]
    assert res["hypic_w8@fp32"]["kl"] == pytest.approx(res["hypic_w8"]["kl"], abs=1e-9)
    assert "same" not in res["hypic_w8@fp32"] and "same" not in res["hypic_w8"]
    r = res["hypic_w8@bf16"]
    assert r["same"] == (r["pred"] == res["hypic_w8@fp32"]["pred"])
    # bf16 rounding moves the distribution, measurably but by far less than reuse itself does
    assert 0.0 < r["kl_ref"] < 1e-3


def test_fp8_entries_of_the_bundled_model_stay_finite(engine):
    from bench.quality import eval as E

    segments, query, answer = E.prompt_ids(engine, "update", 1)
    res = E.run_prompt(engine, segments, query, answer, ("full", "hypic_w8@fp32", "hypic_w8@fp8t", "hypic_w8@fp8"))
    assert res["hypic_w8@fp8"]["kl_ref"] >= 0.0 and res["hypic_w8@fp8t"]["kl_ref"] >= 0.0  # NaN compares false


def test_fp8_scale_of_a_head_decayed_to_denormals_is_defined():
    """compact.head_scale: a head whose largest value is a denormal stores zeros, not 0/0 = NaN;
    the other heads of the same tensor keep their per-head error bound."""
    import torch

    from common.engine.pic import compact

    x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    x[1] = 0.0
    x[1, 2, 3] = 1.4e-45  # the value seen on the bundled model (layer 0, head 1)
    back = compact.round_trip(x, "fp8")
    assert torch.isfinite(back).all()
    assert back[1].abs().max() <= 1e-38
    for h in (0, 2):  # e4m3's 3 mantissa bits: within 1/16 of the head's largest value
        assert (back[h] - x[h]).abs().max() <= x[h].abs().max() / 16


def test_the_format_engine_builds_and_checks_its_format(engine):
    from bench.quality import formats
    from common.engine.pic.entry import EntryMismatch

    seg = engine.tokenizer("k1 v1 . k2 v2 . k3 v3 . k4 v4", add_special_tokens=False)["input_ids"]
    bf16 = formats.engine_at(engine, "bf16")
    assert bf16.model is engine.model and engine.entry_format == "fp32" and bf16.entry_format == "bf16"
    entry = bf16.build_entry(seg, 8)
    assert entry.format == "bf16"
    with pytest.raises(EntryMismatch):  # the fp32 engine refuses it: a format mode never mixes them
        engine.check_entry(entry, seg, 8)
    assert formats.parse_format_mode(formats.format_mode("fp8")) == (formats.FORMAT_SEAM, "fp8")
    with pytest.raises(ValueError):
        formats.parse_format_mode("hypic_w8@fp16")


def test_paired_figures_count_flips_both_ways():
    from bench.quality import eval as E
    from bench.quality import formats

    paired: dict = {}
    # four prompts: the same right answer, a flip that loses, a flip that wins, both wrong differently
    for ok, ref_ok, same in ((True, True, True), (False, True, False), (True, False, False), (False, False, False)):
        res = {"hypic_w8@fp32": {"ok": ref_ok}, "hypic_w8@bf16": {"ok": ok, "same": same, "kl_ref": 0.5 * (not same)}}
        formats.collect(paired, "retrieval", res)
    fig = formats.paired_figures(paired, E.wilson)["paired"]["retrieval"]["hypic_w8@bf16"]
    assert (fig["n"], fig["differ"], fig["reference_only_right"], fig["format_only_right"]) == (4, 3, 1, 1)
    assert fig["delta_pts"] == 0.0 and fig["kl_vs_reference_max"] == 0.5
    assert fig["kl_vs_reference_mean"] == pytest.approx(0.375)
    assert fig["differ_pct_interval95"] == pytest.approx(list(E.wilson(3, 4)))
    assert formats.paired_figures({}, E.wilson) == {}


def test_entry_formats_flag_writes_paired_results(tmp_path):
    from bench.quality import eval as E

    n = torch.get_num_threads()
    try:
        assert E.main(["--n", "2", "--tasks", "retrieval", "--entry-formats", "bf16", "--out", str(tmp_path)]) == 0
    finally:  # evaluate's worker set-up (in this process with one worker) sets both
        torch.set_num_threads(n)
        torch.set_flush_denormal(False)
    res = json.loads((tmp_path / "quality_formats.json").read_text())
    assert res["modes"] == ["full", "hypic_w8@fp32", "hypic_w8@bf16"]  # fp32 always there: the reference
    fig = res["paired"]["retrieval"]["hypic_w8@bf16"]
    assert fig["n"] == 2 and 0 <= fig["differ"] <= 2
    acc = res["accuracy"]["retrieval"]
    assert fig["delta_pts"] == pytest.approx(acc["hypic_w8@bf16"] - acc["hypic_w8@fp32"])
    md = (tmp_path / "quality_formats.md").read_text()
    assert "hypic w=8, bf16 entries" in md and "Paired with fp32 entries" in md
    assert not (tmp_path / "quality.json").exists()
