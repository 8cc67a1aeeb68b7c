"""Issue 14 (trust) at segcache: sealed entries only, uploads within a memory budget, damaged
LMDB records and files. A real segcache process on 127.0.0.1, real LMDB in tmp dirs.

Entries here are built by hand (b"HYPE" | u32 header length | header JSON | payload): segcache
reads only the header, and this module needs no torch model."""
from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.fingerprint import segment_key
from common.pic.seal import ForgedEntry, open_sealed, seal
from common.rpc.segcache_client import SegcacheClient
from protos.hypic.v1 import segcache_pb2 as pb
from test_segcache_service import arun, code_of, launch  # noqa: F401  (launch: a fixture)

pytestmark = pytest.mark.timeout(180)
KiB, MiB = 1 << 10, 1 << 20
FP = "ab" * 32


def fake_entry(token_ids: list[int], payload: bytes, seam: int = 8) -> bytes:
    header = json.dumps({"version": 1, "token_ids": token_ids, "seam": seam, "fingerprint": FP,
                         "dtype": "float32", "layers": [], "checksum": ""}).encode()
    return b"HYPE" + struct.pack("<I", len(header)) + header + payload


def key_of(token_ids: list[int], seam: int = 8) -> str:
    return segment_key(FP, seam, "float32", token_ids)


# ---- sealed entries ----------------------------------------------------------------------------
def test_seal_binds_header_payload_and_key(fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    ids = rng.integers(0, 50_000, 40).tolist()
    secret = rng.bytes(32)
    entry = fake_entry(ids, rng.bytes(1000))
    sealed = seal(entry, secret)
    assert bytes(open_sealed(sealed, key_of(ids), secret)) == entry
    other_ids = list(ids)
    other_ids[rng.integers(0, 40)] ^= 1
    bad = {
        "wrong secret": (sealed, key_of(ids), rng.bytes(32)),
        "no secret": (sealed, key_of(ids), b""),
        "another key": (sealed, key_of(other_ids), secret),
        "another seam": (sealed, key_of(ids, seam=4), secret),
        "unsealed": (entry, key_of(ids), secret),
        "header rewritten and resealed without the secret": (
            seal(fake_entry(other_ids, entry[-1000:]), b""), key_of(other_ids), secret),
    }
    for i in range(0, len(sealed), max(1, len(sealed) // 50)):  # a flipped bit anywhere
        flipped = bytearray(sealed)
        flipped[i] ^= 1 << int(rng.integers(0, 8))
        bad[f"bit flip at {i}"] = (bytes(flipped), key_of(ids), secret)
    for name, (data, key, s) in bad.items():
        with pytest.raises(ForgedEntry):
            open_sealed(data, key, s)
            pytest.fail(name)


def test_segcache_with_a_secret_stores_only_sealed_entries_for_their_key(launch, tmp_path: Path,
                                                                         fresh_seed: int) -> None:
    secret = os.urandom(16).hex().encode()
    (tmp_path / "entry.key").write_bytes(secret + b"\n")
    srv = launch("--no-nixl", "--entry-key-file", str(tmp_path / "entry.key"))
    rng = np.random.default_rng(fresh_seed)
    ids = rng.integers(0, 1000, 30).tolist()
    victim = rng.integers(0, 1000, 30).tolist()
    good = seal(fake_entry(ids, rng.bytes(4096)), secret)
    forged = seal(fake_entry(victim, rng.bytes(4096)), b"guess")

    async def run():
        async with SegcacheClient(srv.target) as sc:
            refused = {
                "random bytes": await code_of(sc.put(key_of(victim), rng.bytes(5000))),
                "wrong secret": await code_of(sc.put(key_of(victim), forged)),
                "under another key": await code_of(sc.put(key_of(victim), good)),
            }
            assert set(refused.values()) == {grpc.StatusCode.INVALID_ARGUMENT}, refused
            assert [e.tier for e in await sc.lookup([key_of(victim)])] == [pb.TIER_MISS]
            assert (await sc.put(key_of(ids), good)).created
            assert bytes(await sc.get(key_of(ids))) == good
    arun(run())
