"""hypic_segcache_misses_total{tier} counts misses (issue 29: it read 0 on every tier while
misses were only counted as lookups_total{tier="miss"}), and no metric exports a `_created` series."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.segcache.config import SegcacheConfig
from services.segcache.metrics import StoreCollector
from services.segcache.store import SegmentStore

MiB = 1 << 20


def _scrape(store: SegmentStore) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_lookup_misses_count_as_misses_of_every_tier(tmp_path: Path) -> None:
    store = SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False,
                                        host_bytes=1 * MiB, disk_bytes=4 * MiB))
    try:
        store.put("present", b"x" * 1000, recompute_cost_s=1.0)
        assert [i is None for i in store.lookup(["present", "absent1", "absent2"])] == \
            [False, True, True]
        metrics = _scrape(store)
        assert metrics['hypic_segcache_lookups_total{tier="miss"}'] == 2
        tiers = {t["name"] for t in store.stats()["tiers"] if t["enabled"]}
        assert tiers
        for tier in tiers:
            assert metrics[f'hypic_segcache_misses_total{{tier="{tier}"}}'] == 2, tier
        assert store.get("absent1") is None  # a read of a key no tier holds: one more each
        assert all(_scrape(store)[f'hypic_segcache_misses_total{{tier="{t}"}}'] == 3 for t in tiers)
    finally:
        store.close()


def test_no_created_series() -> None:
    import common.mesh.metrics as mesh_metrics
    import services.front.metrics as front_metrics

    mesh_metrics.RPC_TOTAL.labels("segcache", "Get", "OK").inc()
    mesh_metrics.RPC_LATENCY.labels("segcache", "Get", "OK").observe(0.01)
    front_metrics.SUCCESS.labels("m", "stop").inc()
    text = generate_latest().decode()
    assert "hypic_rpc_total" in text and "hypic_request_success_total" in text
    assert "_created" not in text
