"""bench/segcache_capacity.py's simulated host tier is what SegmentStore does: the same random
trace (skewed keys, random sizes and costs) through both gives the same hit/miss sequence."""

from __future__ import annotations

import random

import pytest

from bench.segcache_capacity import SimTier
from services.segcache.config import SegcacheConfig
from services.segcache.store import TIER_HOST, SegmentStore


@pytest.mark.parametrize("policy", ["gdsf", "lru"])
def test_sim_tier_matches_segment_store(tmp_path, fresh_seed, policy):
    rng = random.Random(fresh_seed)
    n_keys = 40
    sizes = {f"k{i}": rng.randrange(1_000, 40_000) for i in range(n_keys)}
    costs = {k: rng.uniform(0.01, 2.0) for k in sizes}
    capacity = sum(sizes.values()) // rng.choice([3, 5, 8])
    weights = [1.0 / (r + 1) ** 0.9 for r in range(n_keys)]
    trace = rng.choices(list(sizes), weights=weights, k=600)
    store = SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", host_bytes=capacity,
                                        disk_bytes=64 << 20, lmdb_sync=False, policy=policy))
    sim = SimTier(capacity, policy)
    real, simulated = [], []
    try:
        for key in trace:
            info = store.lookup([key])[0]
            real.append(info is not None and info.tier == TIER_HOST)
            if info is None:
                store.put(key, rng.randbytes(sizes[key]), recompute_cost_s=costs[key])
            else:
                assert store.get(key) is not None
            simulated.append(sim.access(key, sizes[key], costs[key]))
    finally:
        store.close()
    assert 0 < sum(real) < len(real)  # the budget mattered
    first = next((i for i, (a, b) in enumerate(zip(real, simulated)) if a != b), None)
    assert first is None, f"diverged at access {first} ({trace[first]})"


def test_format_study_replay_agrees_with_the_capacity_replay(fresh_seed):
    """replay_costs (the formats study) counts hits as replay (the capacity curves) does, and the
    bytes a request moves are exactly its hits' entry bytes."""
    from bench import workloads as W
    from bench.segcache_capacity import replay
    from bench.segcache_capacity_formats import replay_costs

    rng = random.Random(fresh_seed)
    corpus = W.make_corpus(40, (64, 512), seed=fresh_seed)
    trace = W.rag_trace(corpus, 300, seed=fresh_seed + 1, k=(2, 8), max_prompt_tokens=2048)
    sizes = {d.id: rng.randrange(1_000, 50_000) for d in corpus}
    capacity = sum(sizes.values()) // 4
    ours, theirs = replay_costs(trace, sizes, capacity, 50), replay(trace, sizes, 1, capacity, 50)
    assert 0 < ours["hit_rate"] < 1
    assert ours["hit_rate"] == theirs["hit_rate"] and ours["token_hit_rate"] == theirs["token_hit_rate"]
    assert replay_costs(trace, {d: 1 for d in sizes}, capacity, 50)["hit_bytes_per_request"] > 0
    everything = replay_costs(trace, sizes, sum(sizes.values()), 50)  # cold misses only after warm-up
    counted = [r for r in trace.requests if r.index >= 50]
    assert everything["hit_bytes_per_request"] <= sum(sizes[d] for r in counted for d in r.doc_ids) / len(counted)


def test_bundled_entry_sizes_are_affine_in_tokens_per_format(tmp_path):
    """The formats study's entry model (linear part + bytes per token, fitted on two lengths of
    real entries) predicts the bytes of a real entry of a third length, in every format; compact
    formats shrink the linear part, and only fp8 the keys and values too."""
    from bench.segcache_capacity_formats import SEAM, bundled_entries, entry_size
    from common.engine.dtypes import ENTRY_FORMATS
    from common.engine.hybrid_engine import HybridEngine
    from tests.support.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    fitted = bundled_entries(model, reps=1, lengths=(24, 96))
    engine = HybridEngine.for_worker(model, "float32", "cpu", entry_format="fp32")  # written in each format
    entry = engine.build_entry(list(range(1, 61)), SEAM)
    for f in ENTRY_FORMATS:
        real = len(entry.with_format(f).to_bytes())
        assert abs(entry_size(fitted, f, 60) - real) <= 0.01 * real, (f, entry_size(fitted, f, 60), real)
        if f != "fp8":
            assert abs(fitted[f]["per_token"] - fitted["fp32"]["per_token"]) < 1
    # fp32 keys and values (4 bytes) -> e4m3 (1 byte) + a 4-byte scale per token and kv-head (a
    # quarter, plus the scales, which weigh more with the tiny model's short heads than with 128-wide ones)
    assert 0.25 * fitted["fp32"]["per_token"] < fitted["fp8"]["per_token"] < 0.35 * fitted["fp32"]["per_token"]
    assert fitted["fp8"]["linear"] < fitted["fp8t"]["linear"] < fitted["bf16"]["linear"] < fitted["fp32"]["linear"]
    assert all(fitted[f]["parse_s_per_byte"] > 0 for f in ENTRY_FORMATS)  # (build time: too noisy to test)
