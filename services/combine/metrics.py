"""Prometheus metrics of a combine worker.

Per-RPC latency histograms and call counts come from common.mesh (hypic_rpc_latency_seconds,
hypic_rpc_total, labelled service="combine").
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from common.mesh.metrics import LATENCY_BUCKETS

# stage: fetch (one segcache read), build (one scatter/local build wait), compose (body
# composition of one segment), seams (seam recompute of one segment), compose_layer_major (one
# layer-major pass over every segment: seams and bodies interleave there, so it is not split),
# compose_run (one layer-major pass over a run of two or more arrived segments, seams inside),
# query_prefill, decode_token, ttft, total (one request).
STAGE_SECONDS = Histogram("hypic_combine_stage_seconds", "Latency of each stage of an Execute",
                          ["stage"], buckets=LATENCY_BUCKETS)
# source: where the segment really came from (segcache, scatter, local); via: nixl | grpc | local.
SEGMENTS = Counter("hypic_combine_segments", "Segments composed, by the source actually used",
                   ["source", "via"])
# what: segcache | scatter; reason: miss, unavailable, checksum, mismatch, error ...
FALLBACKS = Counter("hypic_combine_fallbacks", "Fetches or builds that failed and were done elsewhere",
                    ["what", "reason"])
# order: segment (each segment once it and those before it are in hand) | layer (one layer-major
# pass once every entry is in) | mixed (one layer-major pass over the plan's leading run of hits,
# then segment by segment); hypic and additive requests only.
# reason: forged (seal or identity), corrupt (does not parse), mismatch (does not fit the model),
# format (a compact entry of another format than this combine's --entry-format).
DROPPED = Counter("hypic_combine_entries_dropped", "Entries from segcache refused and deleted there",
                  ["reason"])
COMPOSITIONS = Counter("hypic_combine_compositions", "Prompt states composed from entries, by order",
                       ["order"])
# The engine thread's share of a request, by mode (full, prefix, additive, hypic) and phase: prefill
# (a baseline's whole prompt: full or prefix), compose (one composition pass or step, query
# folded in or not), query (a query chunk after composition), decode_token, build (a local entry
# build). Timed on the engine thread itself, so that waiting for it behind other requests is not
# in it: that wait is hypic_combine_engine_wait_seconds{mode}. Side by side they say whether a
# mode serves fewer requests because its engine calls cost more or because they queue.
ENGINE_SECONDS = Histogram("hypic_combine_engine_seconds", "Time of one engine-thread call, queueing excluded",
                           ["mode", "phase"], buckets=LATENCY_BUCKETS)
ENGINE_WAIT_SECONDS = Histogram("hypic_combine_engine_wait_seconds",
                                "Time a call waited for the engine thread (behind other requests' calls)",
                                ["mode"], buckets=LATENCY_BUCKETS)
REQUESTS = Counter("hypic_combine_requests", "Execute calls by mode and outcome", ["mode", "outcome"])
TOKENS = Counter("hypic_combine_generated_tokens", "Tokens generated")
IN_FLIGHT = Gauge("hypic_combine_in_flight", "Execute calls in progress")
# outcome: computed | busy (refused: serving requests or another shadow) | invalid | error
SHADOWS = Counter("hypic_combine_shadows", "Shadow recomputes (issue 26) by outcome", ["outcome"])
# fp32 entries rounded to this combine's compact --entry-format on arrival (instead of a rebuild)
FORMAT_CONVERTED = Counter("hypic_combine_entries_converted", "Entries converted to this combine's entry format",
                           ["stored", "expected"])
