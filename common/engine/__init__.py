"""The engine: everything that runs a model, and nothing that opens a socket.

- hybrid_engine: `HybridEngine`, a checkpoint loaded for prefill, decode, generation and reuse
- loader, models/, layers/: checkpoints and our own modules of every supported architecture
- state, sampling: per-layer model state; token sampling
- pic/: position-independent caching -- segment entries, composition, seams, the prefix baseline
  (pic/reference.py: the plain references that tests and benchmarks compare against)
- modes, fingerprint, checksum: pure-Python rules the mesh shares (no torch): the prefill modes,
  model fingerprints and segment keys, the integrity checksum of entry bytes

Imports nothing of ours but kernels/ (tests/test_layering.py).
"""
