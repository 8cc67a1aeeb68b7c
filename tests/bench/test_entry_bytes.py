"""bench.entry_bytes (the cache-size table of docs/models.md) counts exactly the bytes that real
entries hold: on a tiny checkpoint of every served architecture, its per-segment linear bytes plus
per-token attention bytes equal SegmentEntry.nbytes() of an entry built by the engine."""
import pytest

from bench.entry_bytes import REAL_CONFIGS, build_meta_model, entry_table, layer_sizes
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.compact import ENTRY_FORMATS
from tests.support.tiny import PIC_CONFIGS, save_tiny

# An entry built on every architecture, and the published configs on the meta device: ~1 min.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_type", sorted(PIC_CONFIGS))
def test_counted_bytes_equal_a_real_entry(model_type, tmp_path, fresh_seed):
    path = save_tiny(model_type, tmp_path / model_type, seed=fresh_seed % 1000, **PIC_CONFIGS[model_type])
    eng = HybridEngine.from_pretrained(path)  # fp32: 4-byte keys, values and conv tails
    n = 40 + fresh_seed % 30
    entry = eng.build_entry([(7 * i + fresh_seed) % eng.vocab_size for i in range(n)], seam=8)
    s = layer_sizes(build_meta_model(model_type, PIC_CONFIGS[model_type]), dtype_bytes=4)
    assert s["n_linear"] + s["n_attn"] == sum(b is not None for b in entry.layers)
    assert s["linear_per_segment"] + s["attn_per_token"] * entry.body_len == entry.nbytes()
    for fmt in ENTRY_FORMATS:  # the per-format columns: what entries stored in that format hold
        assert s[f"linear_per_segment_{fmt}"] + s[f"attn_per_token_{fmt}"] * entry.body_len \
            == entry.with_format(fmt).nbytes()


def test_table_covers_the_published_configs():
    rows = {r["model"]: r for r in entry_table(1000, names=["Qwen3-Next-80B-A3B", "MiniMax-Text-01"])}
    qn = rows["Qwen3-Next-80B-A3B"]
    # 36 GDN layers x (T + S: 32 heads x 128 x 128 fp32 each + conv tail 3 x 8192 bf16), 12 attention
    # layers x 1000 tokens x 2 (k, v) x 2 heads x 256 bf16
    assert qn["linear_per_segment"] == 36 * (2 * 32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert qn["attn_kv"] == 12 * 1000 * 2 * 2 * 256 * 2
    mm = rows["MiniMax-Text-01"]  # scalar T per head, no conv
    assert mm["linear_per_segment"] == 70 * (64 * 4 + 64 * 128 * 128 * 4)
    # bf16 T and S: half the fp32 summary bytes, conv tails unchanged
    assert qn["linear_per_segment_bf16"] == 36 * (2 * 32 * 128 * 128 * 2 + 3 * 8192 * 2)
    assert qn["linear_per_segment_fp8"] == 36 * (2 * (32 * 128 * 128 + 4 * 32) + 3 * 8192 * 2)
    assert mm["linear_per_segment_fp8"] == 70 * (64 * 4 + 64 * 128 * 128 + 4 * 64)  # scalar T stays fp32
    # fp8t: T fp8 with a scale per head, S bf16; K/V stay bf16
    assert qn["linear_per_segment_fp8t"] == 36 * (32 * 128 * 128 + 4 * 32 + 32 * 128 * 128 * 2 + 3 * 8192 * 2)
    assert qn["attn_kv_fp8t"] == qn["attn_kv"]
    # fp8: K/V in e4m3 too, one fp32 scale per token and kv-head
    assert qn["attn_kv_fp8"] == 12 * 1000 * 2 * 2 * (256 + 4)
    assert qn["break_even_tokens_fp8"] < qn["break_even_tokens_fp8t"] < qn["break_even_tokens_bf16"] \
        < qn["break_even_tokens_fp32"]
    assert set(REAL_CONFIGS) >= set(rows)


@pytest.mark.parametrize("model_type", ["olmo_hybrid", "kimi_linear"])
def test_lowrank_columns_count_a_real_short_entry(model_type, tmp_path, fresh_seed):
    """The short-body table's "built" bytes: a real entry of a body short enough for low-rank T."""
    from common.engine.pic.compact import lowrank_T_bytes, matrix_T_bytes

    path = save_tiny(model_type, tmp_path / model_type, seed=fresh_seed % 1000, **PIC_CONFIGS[model_type])
    eng = HybridEngine.from_pretrained(path)
    s = layer_sizes(build_meta_model(model_type, PIC_CONFIGS[model_type]), dtype_bytes=4)
    body = 3 + fresh_seed % 4  # K = 32 (OLMo) or 16 (Kimi): low-rank below 16 or 8 tokens
    entry = eng.build_entry([(5 * i + fresh_seed) % eng.vocab_size for i in range(8 + body)], seam=8)
    assert entry.lowrank_layers and entry.body_len == body
    for fmt in ENTRY_FORMATS:
        built = s[f"linear_per_segment_{fmt}"] + s[f"attn_per_token_{fmt}"] * body + sum(
            lowrank_T_bytes(H, body, K, fmt) - matrix_T_bytes(H, K, fmt) for H, K in s["matrix_T_heads"])
        assert built == entry.with_format(fmt).nbytes()


def test_lowrank_table_of_the_published_configs():
    from bench.entry_bytes import lowrank_table

    rows = {(r["model"], r["body"]): r for r in lowrank_table(names=["Qwen3-Next-80B-A3B", "MiniMax-Text-01"])}
    assert {m for m, _ in rows} == {"Qwen3-Next-80B-A3B"}  # scalar T: no low-rank rows
    qn16, qn64 = rows["Qwen3-Next-80B-A3B", 16], rows["Qwen3-Next-80B-A3B", 64]
    # 36 GDN layers x 32 heads: P, Q 16 x 128 fp32 and gamma 128 fp32, against 128 x 128
    assert qn16["dense_fp32"] - qn16["lowrank_fp32"] == 36 * 32 * (128 * 128 - 2 * 16 * 128 - 128) * 4
    assert qn16["dense_fp8"] - qn16["lowrank_fp8"] == 36 * 32 * ((128 * 128 + 4) - (2 * 16 * 128 + 8 + 4 * 128))
    assert qn64["lowrank_fp32"] == qn64["dense_fp32"]  # 2 x 64 >= 128: dense
