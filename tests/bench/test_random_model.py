"""bench.random_model: the spec parser and a saved random checkpoint our engine loads."""
import pytest

from bench.random_model import RANDOM_LABEL, describe, layer_types, parse_spec, save_random_model


def test_spec_parsing_and_layer_pattern():
    s = parse_spec("hidden=1024,layers=16,ratio=3:1")
    assert (s["hidden"], s["layers"], s["ratio"], s["intermediate"]) == (1024, 16, "3:1", 2048)
    assert layer_types(8, "3:1") == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert layer_types(5, "1:1")[:2] == ["linear_attention", "full_attention"]
    assert RANDOM_LABEL in describe(s)
    for bad in ("hidden=100", "layers=0", "ratio=3", "ratio=a:b", "depth=3", "hidden"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_saved_random_model_loads_and_builds_entries(tmp_path):
    from common.engine.hybrid_engine import HybridEngine

    path = save_random_model("hidden=128,layers=3,ratio=2:1,vocab=300,intermediate=256", tmp_path / "m",
                             tokenizer_from="models/hypic-tiny-qwen35")
    eng = HybridEngine.from_pretrained(path)
    assert eng.model.layer_kinds == ["linear", "linear", "attention"] and eng.vocab_size == 300
    assert (path / "tokenizer.json").exists() and RANDOM_LABEL in (path / "random_model.txt").read_text()
    e = eng.build_entry(list(range(10, 50)), seam=8)
    assert e.body_len == 32 and e.layers[0].T.shape[-1] == e.layers[0].T.shape[-2]
