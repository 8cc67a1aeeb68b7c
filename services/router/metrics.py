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
# Shadow recompute (issue 26, services/router/shadow.py): labelled by model (the model
# directory's name) and seam width (--seam and the guard's widths): bounded label sets.
KL_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
AGREEMENT_BUCKETS = (0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
SHADOW_KL = Histogram("hypic_shadow_kl", "KL(full || hypic) at the query of each shadowed request, nats",
                      ["model", "seam"], buckets=KL_BUCKETS)
SHADOW_AGREEMENT = Histogram("hypic_shadow_agreement", "Fraction of the teacher-forced decode steps "
                             "whose argmax agrees with full recompute", ["model", "seam"],
                             buckets=AGREEMENT_BUCKETS)
SHADOW_TOP1 = Counter("hypic_shadow_top1", "Shadows by top-1 agreement at the query",
                      ["model", "seam", "agree"])
SHADOW_SAMPLED = Counter("hypic_shadow_sampled", "Hypic requests sampled for a shadow", ["model", "seam"])
SHADOW_COMPUTED = Counter("hypic_shadow_shadowed", "Shadows computed", ["model", "seam"])
# reason: queue_full | no_idle_combine | busy (combine refused) | unavailable | error | unfinished
SHADOW_DROPPED = Counter("hypic_shadow_dropped", "Sampled requests whose shadow was not computed",
                         ["model", "seam", "reason"])
SHADOW_OVER = Counter("hypic_shadow_over_threshold", "Shadows over --drift-kl-max or under "
                      "--drift-agreement-min", ["model", "seam"])
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
