"""Router metrics (Prometheus). Per-RPC latency and counts come from common.mesh
(hypic_rpc_latency_seconds / hypic_rpc_total with service="router")."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.mesh.metrics import LATENCY_BUCKETS

REQUESTS = Counter("hypic_router_requests", "Generate requests by mode and outcome (status code)",
                   ["mode", "code"])
IN_FLIGHT = Gauge("hypic_router_in_flight", "Generate requests in flight")
TTFT = Histogram("hypic_router_ttft_seconds", "Router receipt to first token", ["mode"],
                 buckets=LATENCY_BUCKETS)
STAGE = Histogram("hypic_router_stage_seconds", "Router-side stages (tokenize, lookup, plan)",
                  ["stage"], buckets=LATENCY_BUCKETS)
SEGMENTS = Counter("hypic_router_segments", "Segments by where they were served from",
                   ["source"])
LOOKUP_FAILURES = Counter("hypic_router_lookup_failures",
                          "segcache lookups that failed or timed out (served as misses)")
COMBINE_FAILOVERS = Counter("hypic_router_combine_failovers",
                            "Combine services skipped after UNAVAILABLE", ["address"])
WORKER_LOAD = Gauge("hypic_router_worker_load_seconds",
                    "Estimated seconds of build work outstanding per scatter worker", ["worker"])
WORKER_UP = Gauge("hypic_router_worker_up", "Scatter worker answered its last Load poll",
                  ["worker"])
COST_COEF = Gauge("hypic_router_cost_model", "Build cost model t = a + b·L + c·L²", ["coef"])
COST_OBS = Counter("hypic_router_cost_observations", "Builds fed to the cost model")
CLAIMS = Counter("hypic_router_claims", "Build claims on missed segments: granted (built here), "
                 "cached (stored since the lookup), wait (being built elsewhere; combine waits)",
                 ["outcome"])
