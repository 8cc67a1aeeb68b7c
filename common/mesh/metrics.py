"""Prometheus metrics: the HTTP endpoint and the per-RPC metrics every service shares."""

from __future__ import annotations

from prometheus_client import (REGISTRY, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, start_http_server)

# No `_created` series beside every counter and histogram: a scrape twice the size for a
# timestamp no dashboard reads (read at scrape time, so this covers every metric of the process).
disable_created_metrics()

# Latency buckets from 100 µs to ~30 s: unary control RPCs and multi-MiB streams both fit.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)

RPC_LATENCY = Histogram(
    "hypic_rpc_latency_seconds", "Server-side latency of each gRPC call (streams: whole stream)",
    ["service", "method", "code"], buckets=LATENCY_BUCKETS)
RPC_TOTAL = Counter("hypic_rpc_total", "gRPC calls handled", ["service", "method", "code"])


def start_metrics_server(port: int, host: str = "127.0.0.1",
                         registry: CollectorRegistry = REGISTRY) -> int | None:
    """Serve /metrics over HTTP on a daemon thread.

    port < 0: disabled, returns None. port 0: an ephemeral port. Returns the bound port.
    """
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
