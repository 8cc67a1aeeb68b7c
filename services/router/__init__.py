"""The router: the client-facing service (tokenize, look up, plan misses with LPT, hand the plan
to combine, stream tokens back). `python -m services.router --help`; docs/lifecycle.md."""
