"""A pinned entry stays in host memory: memory pressure that moves every other entry out of the
host tier (to disk) leaves a pinned one where it is, whatever its cost and however cold it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.segcache.config import SegcacheConfig
from services.segcache.store import TIER_DISK, TIER_HOST, SegmentStore

KiB = 1 << 10


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_pinned_entry_survives_host_pressure_that_evicts_everything_else(tmp_path: Path) -> None:
    # Host memory for 4 entries, disk for all of them: eviction from host is a demotion to disk.
    store = SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False,
                                        host_bytes=16 * KiB, disk_bytes=1 << 20))
    try:
        # The pinned entry is the cheapest to recompute and never read again: without its pin
        # it is the first one GDSF would evict.
        store.put("pinned", blob(4 * KiB, 0), recompute_cost_s=0.0, pin=True)
        others = [f"other-{i}" for i in range(12)]
        for i, key in enumerate(others):
            store.put(key, blob(4 * KiB, i + 1), recompute_cost_s=1.0 + i)
            store.get(key)  # read: more frequent, so more worth keeping than the pinned entry
        assert store.tier_of("pinned") == TIER_HOST
        tiers = [store.tier_of(k) for k in others]
        assert tiers.count(TIER_HOST) == 3 and tiers.count(TIER_DISK) == 9, tiers
        assert store.stats()["pinned"] == 1
        # Unpinned, it is an ordinary (the least valuable) entry: the next pressure demotes it.
        store.pin(["pinned"], pinned=False)
        store.put("one-more", blob(4 * KiB, 99), recompute_cost_s=5.0)
        assert store.tier_of("pinned") == TIER_DISK
    finally:
        store.close()
