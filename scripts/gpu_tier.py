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
