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
