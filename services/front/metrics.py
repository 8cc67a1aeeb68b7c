"""The front's Prometheus metrics: vLLM's request metrics under the project's `hypic_` namespace
(vllm:time_to_first_token_seconds -> hypic_time_to_first_token_seconds, ...), each with a
`model_name` label, served at GET /metrics beside the HTTP API."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # as every gRPC service does (common/mesh/metrics.py): no `_created` series

# vLLM's request-latency buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

TTFT = Histogram("hypic_time_to_first_token_seconds", "Front receipt to the first token",
                 ["model_name"], buckets=TTFT_BUCKETS)
ITL = Histogram("hypic_inter_token_latency_seconds", "Time between consecutive output tokens",
                ["model_name"], buckets=ITL_BUCKETS)
E2E = Histogram("hypic_e2e_request_latency_seconds", "Front receipt to the last token",
                ["model_name"], buckets=E2E_BUCKETS)
PROMPT_TOKENS = Counter("hypic_prompt_tokens", "Prefill tokens processed", ["model_name"])
GENERATION_TOKENS = Counter("hypic_generation_tokens", "Generated tokens", ["model_name"])
CACHED_PROMPT_TOKENS = Counter("hypic_prompt_tokens_cached",
                               "Prompt tokens served from cache, by segcache tier",
                               ["model_name", "tier"])
PROMPT_TOKENS_HIST = Histogram("hypic_request_prompt_tokens", "Prompt tokens per request",
                               ["model_name"], buckets=TOKEN_BUCKETS)
GENERATION_TOKENS_HIST = Histogram("hypic_request_generation_tokens",
                                   "Generated tokens per request", ["model_name"],
                                   buckets=TOKEN_BUCKETS)
SUCCESS = Counter("hypic_request_success", "Finished requests by finish reason",
                  ["model_name", "finished_reason"])
RUNNING = Gauge("hypic_num_requests_running", "Requests in flight at the front", ["model_name"])
WAITING = Gauge("hypic_num_requests_waiting", "Requests at the front still waiting for their "
                "first token (queued or being prefilled behind the router)", ["model_name"])
CACHE_USAGE = Gauge("hypic_cache_usage_perc", "Segment cache bytes held / budget per tier, over "
                    "the router's segcache instances (1 = full); refreshed at each scrape",
                    ["model_name", "tier"])
# The router's shadow recompute figures (docs/drift.md), refreshed at each scrape
# (services/front/drift_figures.py): means over the router's last `window` shadows.
SHADOW_KL_MEAN = Gauge("hypic_shadow_rolling_kl_mean", "Router's mean KL(full || hypic) at the query "
                       "over its last shadows, nats", ["model_name"])
SHADOW_TOP1_RATE = Gauge("hypic_shadow_rolling_top1_rate", "Router's fraction of its last shadows whose "
                         "top-1 token at the query agrees with full recompute", ["model_name"])
SHADOW_AGREEMENT_MEAN = Gauge("hypic_shadow_rolling_agreement_mean", "Router's mean teacher-forced "
                              "decode agreement over its last shadows", ["model_name"])
SHADOW_WINDOW = Gauge("hypic_shadow_rolling_window", "Shadows the rolling figures are over",
                      ["model_name"])
SHADOW_SAMPLE_RATE = Gauge("hypic_shadow_sample_rate", "Fraction of hypic requests the router samples "
                           "for a shadow recompute", ["model_name"])
# count: sampled | shadowed | dropped | over_threshold (the router's totals since it started)
SHADOW_COUNTS = Gauge("hypic_shadow_counts", "The router's shadow recompute counts",
                      ["model_name", "count"])
HTTP = Counter("hypic_front_http_requests", "HTTP requests by endpoint and status",
               ["endpoint", "status"])

# Every label set is bounded whatever the clients send (issue 30): request paths and status codes
# are mapped onto these fixed sets, unauthenticated requests are counted under one endpoint name,
# and the model_name label is always the served model's name (never the request's "model").
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                         "/metrics"})
OTHER = "other"
UNAUTHENTICATED = "unauthenticated"
KNOWN_STATUSES = frozenset({200, 400, 401, 403, 404, 405, 413, 422, 429, 500, 502, 503, 504})


def endpoint_label(path: str) -> str:
    """The endpoint label of a request path: the path itself when the front serves it, else "other"."""
    return path if path in KNOWN_PATHS else OTHER


def status_label(status: int) -> str:
    """The status label of an HTTP status: the code when it is one the front answers with, else
    its class ("2xx" ... "5xx")."""
    return str(status) if status in KNOWN_STATUSES else f"{min(max(status // 100, 1), 5)}xx"


TIERS = frozenset({"device", "host", "disk", "remote", "unknown"})


def tier_label(tier: str) -> str:
    """The tier label of a router-reported cache tier: one of TIERS ("unknown" for anything else)."""
    return tier if tier in TIERS else "unknown"
