"""Service plumbing shared by every Hypic gRPC service (router, scatter, combine, segcache).

- config: a typed config dataclass from CLI flags and HYPIC_* environment variables
- log: structlog JSON logging; a request id bound from gRPC metadata (x-request-id)
- metrics: the Prometheus HTTP endpoint
- server: a grpc.aio server bound to 127.0.0.1 by default, with message-size limits, the
  grpc.health.v1 service and graceful shutdown on SIGTERM/SIGINT (uvloop when available)
- nixl_util: guarded import of NIXL and a small thread-safe agent wrapper
- segcache_client: the client of the segcache service (services must not import each other)

Nothing here imports from services/.
"""
