"""Prometheus view of the store, read at scrape time (no double bookkeeping).

Per-RPC latency histograms and call counts come from common.mesh (hypic_rpc_latency_seconds,
hypic_rpc_total, labelled service="segcache").
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.segcache.records import FORMAT_LABELS
from services.segcache.store import SegmentStore


class StoreCollector(Collector):
    def __init__(self, store: SegmentStore, leases_active: Callable[[], int] = lambda: 0):
        self.store = store
        self.leases_active = leases_active

    def collect(self) -> Iterator:
        s = self.store.stats()
        fams = {
            "hits": CounterMetricFamily("hypic_segcache_hits", "Reads answered by a tier", labels=["tier"]),
            "misses": CounterMetricFamily("hypic_segcache_misses", "Lookups and reads a tier could not answer (a key no tier holds misses every tier)", labels=["tier"]),
            "evictions": CounterMetricFamily("hypic_segcache_evictions", "Entries evicted from a tier", labels=["tier"]),
            "promotions": CounterMetricFamily("hypic_segcache_promotions", "Entries promoted into a tier", labels=["tier"]),
            "bytes": GaugeMetricFamily("hypic_segcache_bytes", "Bytes held by a tier", labels=["tier"]),
            "peak_bytes": GaugeMetricFamily("hypic_segcache_peak_bytes", "High-water mark of a tier's bytes", labels=["tier"]),
            "budget_bytes": GaugeMetricFamily("hypic_segcache_budget_bytes", "A tier's byte budget (0: off)", labels=["tier"]),
            "entries": GaugeMetricFamily("hypic_segcache_entries", "Entries held by a tier", labels=["tier"]),
        }
        for t in s["tiers"]:
            for name, fam in fams.items():
                fam.add_metric([t["name"]], t[name])
        yield from fams.values()
        yield from _format_families(s)
        lk = CounterMetricFamily("hypic_segcache_lookups", "Lookup answers by tier", labels=["tier"])
        for tier, n in s["lookup_hits"].items():
            lk.add_metric([tier], n)
        lk.add_metric(["miss"], s["lookup_misses"])
        yield lk
        yield CounterMetricFamily("hypic_segcache_corrupt_dropped", "Entries dropped on a failed checksum",
                                  value=s["corrupt_dropped"])
        yield GaugeMetricFamily("hypic_segcache_leases_active", "Open NIXL leases", value=self.leases_active())
        yield GaugeMetricFamily("hypic_segcache_pending_writes", "Write-behind entries not yet in LMDB",
                                value=s["pending_writes"])


def _format_families(stats: dict) -> Iterator:
    """Bytes and entries per tier per entry format (every known format and "other", zeros
    included, on every enabled tier: a steady set of series)."""
    fb = GaugeMetricFamily("hypic_segcache_format_bytes", "Bytes held by a tier in entries of a storage "
                           "format (the entry header's; other: unknown or not an entry)", labels=["tier", "format"])
    fe = GaugeMetricFamily("hypic_segcache_format_entries", "Entries held by a tier in a storage format",
                           labels=["tier", "format"])
    for t in stats["tiers"]:
        if not t["enabled"]:
            continue
        for fmt in FORMAT_LABELS:
            nbytes, n = stats["formats"].get((t["name"], fmt), (0, 0))
            fb.add_metric([t["name"], fmt], nbytes)
            fe.add_metric([t["name"], fmt], n)
    yield fb
    yield fe


# reason: forged (not a sealed entry for its key), budget (in-flight upload bytes over budget),
# stalled (an upload that stopped sending). Counted where they happen, not read from the store.
REFUSED = Counter("hypic_segcache_puts_refused", "Puts refused before anything was stored", ["reason"])
