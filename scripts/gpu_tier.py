"""gpu-check's segcache device-tier rows (scripts/gpu_check.py).

  segcache device tier      a 64 MiB put lands in tier 0 (GPU memory) and a Get reads it back
                            intact (that read is the host path: device -> host copy);
  device tier -> reader     two processes, as segcache and a combine on one GPU: the holder
    by CUDA IPC             (a SegmentStore with tier 0) serves the entry through
                            services/segcache/device_reads.py to a reader that says where it is
                            (common.mesh.transfer_path.local_place); on CUDA the path must be
                            "ipc" and the reader maps the handle and copies device to device
                            (open_ipc), no host round trip, checked byte for byte (GB/s include
                            the mapping). On a CPU "device" the same code must choose "host"
                            and the bytes come through the pipe, which is what
                            tests/deploy/test_gpu_check.py runs.
  combine fetch over        a real segcache process (tier 0 on the GPU, the mesh secret) and the
    CUDA IPC                combine's read (services/combine/device_fetch.py) of a sealed entry
                            built on the same GPU: a device lease, the entry parsed from device
                            bytes, equal to the host read's. Skipped without CUDA (its CPU tests:
                            tests/services/combine/test_device_fetch.py, with stand-ins for CUDA).
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

MiB = 1 << 20
KEY = "gpu-check-ipc"


def _pattern(nbytes: int):
    import numpy as np

    return np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)


def _store(data_dir: Path, nbytes: int, device_index: int = 0):
    from services.segcache.config import SegcacheConfig
    from services.segcache.store import SegmentStore

    return SegmentStore(SegcacheConfig(data_dir=data_dir, device_bytes=8 * nbytes, host_bytes=8 * nbytes,
                                       disk_bytes=32 * nbytes, lmdb_sync=False, device_index=device_index))


def row_segcache(tmp: Path, nbytes: int = 64 * MiB):
    import numpy as np

    from services.segcache.store import TIER_DEVICE

    store = _store(tmp / "segcache", nbytes)
    try:
        data = _pattern(nbytes)
        store.put("gpu-check", data)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            info, got = store.get("gpu-check")
            best = min(best, time.perf_counter() - t0)
        ok = info.tier == TIER_DEVICE and np.array_equal(got, data)
        return ("ok" if ok else "FAIL", f"{nbytes / best / 1e9:.1f} GB/s",
                f"{nbytes / MiB:.0f} MiB put -> tier {info.tier} (device {TIER_DEVICE}); Get = device->host copy")
    finally:
        store.close()


def _ipc_holder(conn, data_dir: str, nbytes: int, device_index: int) -> None:  # a spawned process: segcache
    import numpy as np

    from common.mesh.transfer_path import Capabilities
    from services.segcache.device_reads import DeviceReads

    try:
        store = _store(Path(data_dir), nbytes, device_index)
    except Exception as e:  # the reader says what failed instead of waiting for nothing
        conn.send(dict(error=f"{type(e).__name__}: {e}"))
        return
    try:
        store.put(KEY, _pattern(nbytes))
        reader = conn.recv()  # the reader's Place
        reads = DeviceReads(store)
        served = reads.serve(KEY, reader, Capabilities(cuda_ipc=True))
        host = None if served.ipc is not None else np.asarray(served.host.buf).tobytes()  # host path: the bytes
        conn.send(dict(path=served.path, tried=served.tried, tier=served.info.tier, holder=reads.holder(KEY),
                       ipc=None if served.ipc is None else dataclasses.asdict(served.ipc), host=host))
        conn.recv()  # the reader is done with the mapping
        reads.release(served)
    except Exception as e:
        conn.send(dict(error=f"{type(e).__name__}: {e}"))
    finally:
        store.close()


def row_ipc(tmp: Path, device: str, nbytes: int = 64 * MiB):
    """Device tier -> a reader in another process on the same device, by the path the policy picks."""
    import multiprocessing as mp

    import torch

    from common.mesh.transfer_path import IpcHandle, local_place, open_ipc

    device = torch.device(device)
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    want = torch.from_numpy(_pattern(nbytes)).to(device)  # also the reader's CUDA context, before timing
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_holder, args=(child, str(tmp / "segcache-ipc"), nbytes, index), daemon=True)
    proc.start()
    try:
        parent.send(local_place(device))
        if not parent.poll(180):
            return "FAIL", "", "the holder process sent nothing in 180 s"
        got = parent.recv()
        if "error" in got:
            return "FAIL", "", f"the holder process: {got['error']}"
        t0 = time.perf_counter()
        if got["ipc"] is not None:
            out = open_ipc(IpcHandle(**got["ipc"]), device)  # maps, copies device to device, syncs
        else:
            out = torch.frombuffer(bytearray(got["host"]), dtype=torch.uint8).to(device)
        secs = time.perf_counter() - t0
        expected = "ipc" if cuda else "host"
        ok = got["path"] == expected and torch.equal(out, want)
        return ("ok" if ok else "FAIL", f"{got['path']} {nbytes / secs / 1e9:.1f} GB/s",
                f"{nbytes / MiB:.0f} MiB in tier {got['tier']}, holder {got['holder']}, reader {local_place(device)}; "
                f"path {got['path']} (expected {expected}); faster paths tried: {got['tried'] or 'none'}")
    finally:
        try:
            parent.send("done")
        except OSError:  # the holder is gone already
            pass
        proc.join(60)
        if proc.is_alive():
            proc.kill()


# ---- the whole combine fetch over CUDA IPC ------------------------------------------------------
def _start_segcache(tmp: Path, args: list[str]):
    """`python -m services.segcache` on an ephemeral port: (process, target, log path)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    port_file, log_path = tmp / "segcache-combine.port.json", tmp / "segcache-combine.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.segcache", "--port", "0", "--port-file",
                                 str(port_file), "--data-dir", str(tmp / "segcache-combine"), *args], cwd=root,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(  # keep gpu_check's wheels
                                    [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])},
                                stdout=log, stderr=log)
    end = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"segcache did not start: {log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{json.loads(port_file.read_text())['port']}", log_path


def _tensors(entry) -> list:
    from common.engine.pic.entry import AttentionBody, LinearBody

    out = []
    for b in entry.layers:
        if isinstance(b, LinearBody):
            out += [b.T, b.S, b.conv_tail, b.warmup_inputs]
        elif isinstance(b, AttentionBody):
            out += [b.keys, b.values]
    return out


def _same_entry(got, want) -> bool:
    """Every tensor equal, on the same device, in the same dtype."""
    import torch

    pairs = list(zip(_tensors(got), _tensors(want)))
    return len(_tensors(got)) == len(_tensors(want)) and all(
        (a is None and b is None) or (a is not None and b is not None and a.device == b.device
                                      and a.dtype == b.dtype and torch.equal(a, b)) for a, b in pairs)


async def _fetch_both_ways(target: str, key: str, data: bytes, secret: bytes, engine, check):
    """Put the sealed entry, then the combine's read by its place (device_fetch; a combine off CUDA
    has none) and the host read (Get, seal, from_bytes, place): (tier after the Put, path, entry by
    that read, ms, entry by the host read, ms)."""
    import asyncio

    from common.engine.pic.entry import SegmentEntry
    from common.engine.pic.placement import place_for_engine
    from common.engine.pic.seal import open_sealed
    from common.mesh.segcache_client import SegcacheClient
    from services.combine.device_fetch import fetch_at_place, reader_place

    host_parse = lambda buf: place_for_engine(SegmentEntry.from_bytes(open_sealed(buf, key, secret), sealed=True),  # noqa: E731
                                              engine)
    async with SegcacheClient(target, timeout_s=60) as sc:
        await sc.put(key, data)
        tier = (await sc.lookup([key]))[0].tier
        place = reader_place(engine.device, sealed=True)
        background: list = []
        spawn = lambda c: background.append(asyncio.create_task(c))  # noqa: E731
        for _ in range(2):  # the first one warms up (CUDA context of the mapping, connection)
            t0 = time.perf_counter()
            hit = await fetch_at_place(sc, key, place, engine, check, request_id="gpu-check", timeout=60, spawn=spawn)
            path = "ipc" if hit.entry is not None else "host" if hit.data is not None else "fallback"
            got = hit.entry if hit.entry is not None else host_parse(hit.data) if hit.data is not None else None
            placed_ms = (time.perf_counter() - t0) * 1e3
        await asyncio.gather(*background)
        t0 = time.perf_counter()
        _, buf = await sc.get_with_info(key, verify=False)
        host = host_parse(buf)
        host_ms = (time.perf_counter() - t0) * 1e3
    return tier, path, got, placed_ms, host, host_ms


def row_combine_ipc(tmp: Path, device: str, n_tokens: int = 2048, walk_on_cpu: bool = False):
    """A real segcache process with tier 0 on `device` (and the mesh secret: it checks seals at
    Put), and the combine's fetch (services/combine/device_fetch.py) of a sealed entry built by a
    tiny qwen3_next engine on the same GPU: the path must be "ipc" and the entry, parsed from
    device bytes, equal to the host read's (on the engine's device, in its dtypes). Without CUDA
    it skips; walk_on_cpu runs its code on CPU instead (tests/deploy/test_gpu_check.py), where
    there is no tier 0 and no place: the path must be "host"."""
    import asyncio
    import os

    import torch

    from common.engine.hybrid_engine import HybridEngine
    from common.engine.pic.seal import load_secret, seal
    from tests.support.tiny import PIC_CONFIGS, save_tiny

    device = torch.device(device)
    cuda = device.type == "cuda"
    if not (cuda or walk_on_cpu):
        return "skip", "", "no CUDA: a combine off CUDA sends no place (CPU tests: tests/services/combine/test_device_fetch.py)"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0
    key_file = tmp / "combine-ipc.key"
    key_file.write_text(os.urandom(32).hex())
    path = save_tiny("qwen3_next", tmp / "combine-ipc-model", seed=3, **PIC_CONFIGS["qwen3_next"])
    engine = HybridEngine.from_pretrained(path, dtype=torch.bfloat16, device=f"cuda:{index}" if cuda else "cpu")
    ids = torch.randint(0, engine.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(4)).tolist()
    entry = engine.build_entry(ids, 4)
    secret = load_secret(key_file)
    data = seal(entry.to_bytes(), secret)
    check = lambda e: engine.check_entry(e, ids, 4)  # noqa: E731
    proc, target, log_path = _start_segcache(tmp, ["--device-bytes", str(256 * MiB), "--device-index", str(index),
                                                   "--no-nixl", "--entry-key-file", str(key_file)])
    try:
        tier, path_used, got, placed_ms, host, host_ms = asyncio.run(
            _fetch_both_ways(target, entry.key, data, secret, engine, check))
    finally:
        proc.terminate()
        proc.wait(30)
    want_tier, want_path = (1, "ipc") if cuda else (2, "host")
    same = got is not None and _same_entry(got, host)
    ok = tier == want_tier and path_used == want_path and same
    return ("ok" if ok else "FAIL", f"{path_used} {placed_ms:.1f} ms, host {host_ms:.1f} ms",
            f"{len(data) / MiB:.2f} MiB entry ({n_tokens} tokens), tier {tier} after Put (expected {want_tier}); "
            f"path {path_used} (expected {want_path}); entry equal to the host read's: {same}")
