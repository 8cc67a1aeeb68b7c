"""Entries built by hand (b"HYPE" | u32 header length | header JSON | payload), for tests of what
segcache and its clients do with entry bytes: segcache reads only the header, so these need no model."""
from __future__ import annotations

import json
import struct

from common.engine.fingerprint import segment_key

FP = "ab" * 32


def fake_entry(token_ids: list[int], payload: bytes, seam: int = 8) -> bytes:
    header = json.dumps({"version": 1, "token_ids": token_ids, "seam": seam, "fingerprint": FP,
                         "dtype": "float32", "layers": [], "checksum": ""}).encode()
    return b"HYPE" + struct.pack("<I", len(header)) + header + payload


def key_of(token_ids: list[int], seam: int = 8) -> str:
    return segment_key(FP, seam, "float32", token_ids)
