"""Model fingerprint and segment keys without torch or model code (the router needs both).

    fp = model_fingerprint(model_dir)             # identifies config.json + the safetensors bytes
    key = segment_key(fp, seam, "float32", ids)   # content address of one segment entry

These are the single definitions: common.engine.hybrid_engine (`HybridEngine.fingerprint`) and
common.engine.pic.entry (`segment_key`) must give the same values (tests/test_router.py checks it).
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any, Sequence

from common.engine.dtypes import name_of


def model_fingerprint(path: str | Path) -> str:
    """Identifies the weights (config + safetensors bytes), stable across processes and machines.

    Checkpoints up to 1 GiB are hashed whole; larger ones by their headers, sizes and a 1 MiB
    sample every 64 MiB, so that a 100 GB model still loads in seconds.
    """
    path = Path(path)
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    files = sorted(path.glob("*.safetensors"))
    whole = sum(f.stat().st_size for f in files) <= 1 << 30
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            if whole:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            else:
                for off in range(0, size, 64 << 20):
                    fh.seek(off)
                    h.update(fh.read(1 << 20))
    return h.hexdigest()


def segment_key(model_fingerprint: str, seam: int, dtype: Any, token_ids: Sequence[int]) -> str:
    """Content address of a segment entry: the same everywhere (never Python's hash()).

    The personalisation string names the entries' content: it changes whenever what an entry
    holds for the same model, seam, dtype and tokens changes, so that entries of the old kind are
    never found (a miss and a rebuild, not a wrong answer). v2: MLA layers (Ling's bailing_hybrid)
    hold the compressed latent and rope key, as Kimi-Linear's do, no longer the expanded KV."""
    h = hashlib.blake2b(digest_size=20, person=b"hypic-seg-v2")
    h.update(model_fingerprint.encode() + b"\0" + name_of(dtype).encode() + b"\0")
    h.update(struct.pack("<iI", int(seam), len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *[int(t) for t in token_ids]))
    return h.hexdigest()
