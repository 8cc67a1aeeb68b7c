"""An operator who restarts segcache with a smaller disk budget gets a store within that budget:
the least valuable entries are evicted at start (pinned ones kept), and for good -- deleted from
LMDB, so the file shrinks back under the budget and a later start with the old budget does not
bring them back."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.segcache.config import SegcacheConfig
from services.segcache.lmdb_file import HEADER
from services.segcache.store import TIER_MISS, SegmentStore

KiB = 1 << 10
ENTRY = 8 * KiB
STORED = ENTRY + HEADER.size  # what one entry costs the disk tier


def open_store(tmp_path: Path, disk_bytes: int) -> SegmentStore:
    return SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False,
                                       host_bytes=64 * KiB, disk_bytes=disk_bytes))


def blob(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, ENTRY, dtype=np.uint8).tobytes()


def test_restart_with_a_smaller_disk_budget_evicts_down_to_it_for_good(tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(10)]
    store = open_store(tmp_path, 1 << 20)
    try:
        for i, k in enumerate(keys):  # k0 pinned; the others' value grows with i
            store.put(k, blob(i), recompute_cost_s=float(i), pin=(i == 0))
    finally:
        store.close()

    store = open_store(tmp_path, 4 * STORED)  # room for 4 of the 10
    try:
        assert store.stats()["entries"] == 4
        assert store.disk.bytes <= store.disk.budget
        kept = [k for k in keys if store.tier_of(k) != TIER_MISS]
        assert kept == ["k0", "k7", "k8", "k9"]  # the pinned one and the three most valuable
        got = store.get("k0")
        assert got is not None and bytes(got[1]) == blob(0)
    finally:
        store.close()

    store = open_store(tmp_path, 1 << 20)  # the old budget again: the evicted stay gone
    try:
        assert [k for k in keys if store.tier_of(k) != TIER_MISS] == ["k0", "k7", "k8", "k9"]
    finally:
        store.close()
