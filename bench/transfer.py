"""The combine's transfer step per MB of entry, before and after "one check per byte, no copies".

    python -m bench.transfer [--sizes-mib 4,30] [--reps 9] [--out bench/results/transfer.json]

1. Hash throughput on this machine (GB/s): blake2b-128, XXH3-128, crc32c, zlib crc32, and a
   memcpy for scale -- what chose common.engine.checksum.
2. A real segcache process on 127.0.0.1 holds one synthetic entry per size (random tensors in
   the layout of a hybrid model's entry). Per rep, round robin so that load hits all alike:

   before_grpc  what combine/fetch.py did: gRPC stream, blake2b of the bytes in the client,
                bytes(buf) copy, blake2b of the payload again in from_bytes, safetensors load
                (a copy of every tensor)
   after_grpc   gRPC stream (no client hash), SegmentEntry.from_bytes: one XXH3 pass, tensors
                viewed in the received buffer
   before_nixl  / after_nixl  the same over a NIXL READ into a fresh buffer (as the combine
                reads), when NIXL is available on this machine

Times are medians; per-MB figures divide by the entry size.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors.torch import load as st_load

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.driver import best  # noqa: E402
from bench.segcache import start_server  # noqa: E402
from common.engine.checksum import checksum  # noqa: E402
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry  # noqa: E402
from common.mesh.segcache_client import SegcacheClient  # noqa: E402

MiB = 1 << 20


def hash_speeds(nbytes: int = 64 * MiB, reps: int = 5) -> dict[str, float]:
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    mv, raw = memoryview(buf), bytes(memoryview(buf))
    fns = {
        "blake2b-128": lambda: hashlib.blake2b(mv, digest_size=16).digest(),
        "xxh3-128": lambda: xxhash.xxh3_128_digest(mv),
        "zlib-crc32": lambda: zlib.crc32(mv),
        "memcpy": lambda: bytearray(mv),
    }
    try:
        import google_crc32c  # optional: the row is left out without it

        fns["crc32c"] = lambda: google_crc32c.value(raw)
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        fastest = best(fn, reps)[0]
        out[name] = round(nbytes / fastest / 1e9, 2)
    return out


def synthetic_entry(nbytes: int, seed: int) -> SegmentEntry:
    """An entry of ~nbytes in a hybrid's layout: 3 linear (T matrix, S) : 1 attention (k, v)."""
    g = torch.Generator().manual_seed(seed)
    H, K, kvh, D, tokens = 16, 128, 4, 128, 504
    lin = 2 * H * K * K * 4
    att = 2 * kvh * tokens * D * 4
    n_groups = max(1, nbytes // (3 * lin + att))
    layers: list = []
    for _ in range(n_groups):
        for _ in range(3):
            layers.append(LinearBody(T=torch.randn(1, H, K, K, generator=g), form="matrix",
                                     S=torch.randn(1, H, K, K, generator=g),
                                     conv_tail=torch.randn(1, 3 * H * K, 3, generator=g), warmup_inputs=None))
        layers.append(AttentionBody(torch.randn(1, kvh, tokens, D, generator=g),
                                    torch.randn(1, kvh, tokens, D, generator=g)))
    return SegmentEntry(list(range(512)), 8, "bench-transfer", "float32", layers)


def old_from_bytes(data: bytes) -> SegmentEntry:
    """from_bytes before "one check per byte, no copies": blake2b of the payload, then safetensors' copying load."""
    n = int.from_bytes(data[4:8], "little")
    payload = data[8 + n: -16]
    hashlib.blake2b(payload, digest_size=16).hexdigest()
    tensors = st_load(payload)
    return SegmentEntry([], 8, "", "float32", [AttentionBody(t, t) for t in tensors.values()])


async def bench_reads(port: int, entries: dict[int, bytes], reps: int) -> dict[int, dict]:
    out = {}
    async with SegcacheClient(f"127.0.0.1:{port}", max_message_bytes=8 * MiB, timeout_s=120) as sc:
        nixl_ok, why = await sc.nixl_available()
        if not nixl_ok:
            print(f"NIXL unavailable: {why}")
        for size, data in entries.items():
            key = f"transfer-{size}"
            await sc.put(key, data, recompute_cost_s=1.0)

            async def before_grpc():
                info, buf = await sc.get_with_info(key, verify=False)
                hashlib.blake2b(buf, digest_size=16).digest()
                old_from_bytes(bytes(buf))

            async def after_grpc():
                _, buf = await sc.get_with_info(key, verify=False)
                SegmentEntry.from_bytes(buf)

            async def before_nixl():
                arr = await sc.get_via_nixl(key, verify=False)
                hashlib.blake2b(memoryview(arr), digest_size=16).digest()
                old_from_bytes(arr.tobytes())

            async def after_nixl():
                SegmentEntry.from_bytes(await sc.get_via_nixl(key, verify=False))

            methods = {"before_grpc_s": before_grpc, "after_grpc_s": after_grpc}
            if nixl_ok:
                methods.update(before_nixl_s=before_nixl, after_nixl_s=after_nixl)
            assert checksum((await sc.get_with_info(key))[1]) == checksum(data)
            times: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(reps):
                for name, fn in methods.items():
                    t = time.perf_counter()
                    await fn()
                    times[name].append(time.perf_counter() - t)
            med = {m: statistics.median(v) for m, v in times.items()}
            out[size] = {"bytes": len(data), **med,
                         **{m.replace("_s", "_ms_per_mb"): 1e3 * v / (len(data) / MiB) for m, v in med.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="4,30")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hashes = hash_speeds()
    print("hash GB/s:", json.dumps(hashes))
    entries = {s: synthetic_entry(s * MiB, seed=s).to_bytes() for s in (int(x) for x in args.sizes_mib.split(","))}
    with tempfile.TemporaryDirectory() as d:
        proc, port = start_server(Path(d), host_bytes=4 * sum(len(b) for b in entries.values()))
        try:
            reads = asyncio.run(bench_reads(port, entries, args.reps))
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"{'MiB':>6} {'path':>5} {'before ms/MB':>13} {'after ms/MB':>12} {'before/after':>13}")
    for size, r in reads.items():
        for path in ("grpc", "nixl"):
            if f"before_{path}_s" in r:
                b, a = r[f"before_{path}_ms_per_mb"], r[f"after_{path}_ms_per_mb"]
                print(f"{r['bytes'] / MiB:6.1f} {path:>5} {b:13.3f} {a:12.3f} {b / a:13.2f}")
    result = {"hash_gbps": hashes, "reads": {str(k): v for k, v in reads.items()}, "reps": args.reps,
              "load_avg": os.getloadavg(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count()}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
