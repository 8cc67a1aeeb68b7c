"""The mesh runtime: what every Hypic gRPC service process shares (router, scatter, combine, segcache).

- the service process: service (one entry point: config -> logging -> server -> serve), config
  (typed dataclasses from flags and HYPIC_* variables), server, log, metrics, guard, handlers,
  abort (clean statuses), discovery (dns:/// targets)
- security: tls (mutual TLS, channels), auth (roles, API and writer keys)
- transport: nixl_util (the NIXL agent wrapper), nixl_listen
- clients: segcache_client, segcache_ring (rendezvous placement over segcache members)
- request checks: checks (what a model worker checks of a plan before any compute)
- tokenizer: the router's and the front's tokenizer, loaded without torch where that is exact

Of the engine it uses only its pure-Python rules (fingerprint, checksum, modes); it never loads
a model: the processes that serve one (scatter, combine) do. Imports no service (tests/test_layering.py).
"""
