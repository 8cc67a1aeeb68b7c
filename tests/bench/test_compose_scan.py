"""bench.compose_scan measures the two composition paths on the same entries and checks they compose
the same state: on tiny checkpoints, a run of factored bodies and a MiniMax run, both paths agree,
and the row says how many layer bodies held factors (the case it claims to measure)."""
import random

from bench.compose_scan import measure, state_rel
from common.engine.hybrid_engine import HybridEngine
from tests.support.tiny import PIC_CONFIGS, save_tiny


def test_both_paths_compose_the_same_state_on_factored_and_lightning_runs(tmp_path, fresh_seed):
    for model_type, seg_len, want_factored in (("qwen3_5_text", 7, True), ("minimax", 20, False)):
        eng = HybridEngine.from_pretrained(save_tiny(model_type, tmp_path / model_type, seed=fresh_seed % 1000,
                                                     **PIC_CONFIGS[model_type]))
        row = measure(eng, model_type, 3, seg_len, 4, 1, random.Random(fresh_seed))
        assert row["state_rel"] < 1e-5 and row["run_s"] > 0 and row["one_by_one_s"] > 0
        assert (row["factored_layer_bodies"] > 0) == want_factored


def test_state_rel_sees_a_different_state(tmp_path):
    eng = HybridEngine.from_pretrained(save_tiny("qwen3_5_text", tmp_path, seed=1, **PIC_CONFIGS["qwen3_5_text"]))
    a = eng.forward([5, 6, 7], eng.new_state())[2]
    b = eng.forward([5, 6, 8], eng.new_state())[2]
    assert state_rel(a, a) == 0.0 and state_rel(a, b) > 1e-3
