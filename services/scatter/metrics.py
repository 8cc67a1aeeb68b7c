"""Prometheus metrics of a scatter worker.

Per-RPC latency histograms and call counts come from common.mesh (hypic_rpc_latency_seconds,
hypic_rpc_total, labelled service="scatter").
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.mesh.metrics import LATENCY_BUCKETS

BUILD_SECONDS = Histogram("hypic_scatter_build_seconds", "Prefill + entry build time of one segment",
                          buckets=LATENCY_BUCKETS)
BUILD_WAIT_SECONDS = Histogram("hypic_scatter_build_queue_seconds",
                               "Time a build waited for a free build worker", buckets=LATENCY_BUCKETS)
BUILDS = Counter("hypic_scatter_builds", "Builds run (not counting joined ones)", ["result"])
BUILD_TOKENS = Counter("hypic_scatter_build_tokens", "Tokens prefilled by builds")
ENTRY_BYTES = Counter("hypic_scatter_entry_bytes", "Bytes of serialized entries built")
ENTRY_BYTES_BY_FORMAT = Counter("hypic_scatter_entry_format_bytes",
                                "Bytes of serialized entries built, by the storage format of their T and S "
                                "(common.engine.pic.compact)", ["format"])
BUILD_WORK = Counter("hypic_scatter_build_work_tokens",
                     "Tokens of builds, by part: done (prefilled; a stopped build counts the share of "
                     "layers it ran) or skipped (a queued build dropped, the layers a stopped build "
                     "never ran)", ["part"])
SHARED = Counter("hypic_scatter_shared_builds", "Build calls that joined a build already in flight")
STORES = Counter("hypic_scatter_stores", "segcache Puts of built entries", ["result"])
IN_FLIGHT = Gauge("hypic_scatter_in_flight", "Builds running or queued")
QUEUED_TOKENS = Gauge("hypic_scatter_queued_tokens", "Tokens of the builds running or queued")
