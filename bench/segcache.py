"""segcache read throughput, tier by tier: host DRAM, LMDB, the shared Mooncake tier, gRPC, NIXL.

    python -m bench.segcache [--sizes-mib 1,16,64] [--reps 7] [--out bench/results/segcache.json]
                             [--no-remote] [--no-capacity]

Starts a real segcache process on 127.0.0.1 (ephemeral port, LMDB in a temp dir), puts one
entry per size and reads it back, reporting the median over --reps of:

  memcpy      np.copyto of the same bytes into a pre-faulted buffer, in this process
  nixl        SegcacheClient.get_via_nixl into a pre-faulted, pre-registered buffer: lease RPC,
              NIXL READ (UCX) and release RPC -- what a reader pays end to end, no checksum
  nixl+verify the same plus the reader's checksum verification (the client default)
  grpc        SegcacheClient.get over the gRPC stream (1 MiB and 4 MiB chunks), no checksum
  lmdb        the disk tier's read path in-process (SegmentStore._read_disk: LMDB read,
              header + checksum verification, copy out), warm page cache and cold (the file's
              pages dropped with posix_fadvise(DONTNEED) after closing the env)
  host tier   SegmentStore.get of an entry in the host tier, in-process, plus the copy into a
              caller's buffer (what any reader of DRAM pays at least)
  mooncake    the shared remote tier (Mooncake Store, a real mooncake_master on 127.0.0.1): the
              segcache server writes each entry behind to the store (its own process holds the
              bytes); this process reads it over TCP loopback: get_into a pre-registered buffer
              (the raw zero-copy read) and remote tier = what segcache does on a local miss
              (get + header/checksum verification + copy out, remote_tier.unpack)

Then (--no-capacity skips it) the hit-rate-vs-capacity curve of bench/segcache_capacity.py for
1, 2, 4 instances (segcache_capacity.json/.png beside --out).

Every read is checked byte-exact once per size before timing. Writes a table to stdout and
the figures to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import segcache_capacity as cap  # noqa: E402
from common.mesh.nixl_util import load_nixl  # noqa: E402
from common.mesh.segcache_client import SegcacheClient  # noqa: E402
from common.mesh.server import run as run_loop  # noqa: E402
from services.segcache.config import SegcacheConfig  # noqa: E402
from services.segcache.remote_tier import unpack  # noqa: E402
from services.segcache.store import TIER_HOST, SegmentStore  # noqa: E402
from hypic.launcher import MooncakeMaster, find_master_binary, mooncake_missing  # noqa: E402

MiB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def start_server(tmp: Path, host_bytes: int, remote: list[str] = ()) -> tuple[subprocess.Popen, int]:
    port_file = tmp / "port.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_SEGCACHE_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.segcache", "--port", "0", "--port-file", str(port_file),
         "--data-dir", str(tmp / "server-lmdb"), "--host-bytes", str(host_bytes),
         "--disk-bytes", str(4 * host_bytes), "--max-message-bytes", str(8 * MiB),
         "--log-level", "warning", *remote],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "wb"))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((tmp / "server.log").read_text())
        time.sleep(0.05)
    return proc, json.loads(port_file.read_text())["port"]


async def bench_service(port: int, payloads: dict[int, bytes], reps: int) -> dict[int, dict]:
    """Per size, each rep times every method once, round robin, so that load changes on a
    shared machine hit all methods alike; reports medians."""
    out: dict[int, dict] = {}
    async with SegcacheClient(f"127.0.0.1:{port}", max_message_bytes=8 * MiB, timeout_s=120) as sc:
        nixl_ok, why = await sc.nixl_available()
        if not nixl_ok:
            print(f"NIXL unavailable: {why}")
        for size, data in payloads.items():
            key = f"bench-{size}"
            await sc.put(key, data, recompute_cost_s=1.0)
            src = np.frombuffer(data, dtype=np.uint8)
            dst = np.ones(size, dtype=np.uint8)  # pre-faulted
            buf = np.ones(size, dtype=np.uint8)
            for chunk in (1 * MiB, 4 * MiB):  # byte-exact once, then untimed verification off
                assert bytes(await sc.get(key, chunk_bytes=chunk)) == data
            handle = None
            if nixl_ok:
                handle = sc.register_buffer(buf)
                assert (await sc.get_via_nixl(key, out=buf, out_registered=True)).tobytes() == data

            async def memcpy():
                np.copyto(dst, src)

            methods = {
                "memcpy_s": memcpy,
                "grpc_1mib_s": lambda: sc.get(key, chunk_bytes=1 * MiB, verify=False),
                "grpc_4mib_s": lambda: sc.get(key, chunk_bytes=4 * MiB, verify=False),
            }
            if nixl_ok:
                methods["nixl_s"] = lambda: sc.get_via_nixl(key, out=buf, out_registered=True, verify=False)
                methods["nixl_verify_s"] = lambda: sc.get_via_nixl(key, out=buf, out_registered=True, verify=True)
            times: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(reps):
                for name, fn in methods.items():
                    t = time.perf_counter()
                    await fn()
                    times[name].append(time.perf_counter() - t)
            if handle is not None:
                sc.deregister_buffer(handle)
            out[size] = {"bytes": size, **{m: statistics.median(v) for m, v in times.items()}}
    return out


def drop_file_cache(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def bench_lmdb(tmp: Path, payloads: dict[int, bytes], reps: int) -> dict[int, dict]:
    cfg = SegcacheConfig(data_dir=tmp / "lmdb-bench", host_bytes=0, disk_bytes=8 * sum(payloads),
                         lmdb_sync=False)
    store = SegmentStore(cfg)
    for size, data in payloads.items():
        store.put(f"bench-{size}", data, recompute_cost_s=1.0)
    out: dict[int, dict] = {}
    for size, data in payloads.items():
        e = store._entries[f"bench-{size}"]
        assert store._read_disk(e).tobytes() == data
        src = np.frombuffer(data, dtype=np.uint8)
        dst = np.ones(size, dtype=np.uint8)
        warm, copy = [], []
        for _ in range(reps):  # interleaved with a memcpy of the same bytes, as in the service phase
            t = time.perf_counter()
            store._read_disk(e)
            warm.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(dst, src)
            copy.append(time.perf_counter() - t)
        out[size] = {"lmdb_warm_s": statistics.median(warm), "memcpy_lmdb_phase_s": statistics.median(copy)}
    store.close()
    data_file = cfg.data_dir / "data.mdb"
    for size in payloads:
        cold = []
        for _ in range(max(3, reps // 2)):
            if not drop_file_cache(data_file):
                break
            store = SegmentStore(cfg)
            e = store._entries[f"bench-{size}"]
            t = time.perf_counter()
            store._read_disk(e)
            cold.append(time.perf_counter() - t)
            store.close()
        if cold:
            out[size]["lmdb_cold_s"] = statistics.median(cold)
    return out


def bench_host(tmp: Path, payloads: dict[int, bytes], reps: int) -> dict[int, dict]:
    """The host tier in-process: SegmentStore.get (a view of its DRAM copy) + copy out."""
    total = sum(map(len, payloads.values()))
    cfg = SegcacheConfig(data_dir=tmp / "host-bench", host_bytes=2 * total + 64 * MiB,
                         disk_bytes=4 * total + 64 * MiB, lmdb_sync=False)
    store = SegmentStore(cfg)
    out: dict[int, dict] = {}
    try:
        for size, data in payloads.items():
            store.put(f"bench-{size}", data, recompute_cost_s=1.0)
        for size, data in payloads.items():
            key = f"bench-{size}"
            info, arr = store.get(key)
            assert info.tier == TIER_HOST and arr.tobytes() == data
            dst = np.ones(size, dtype=np.uint8)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                np.copyto(dst, store.get(key)[1])
                times.append(time.perf_counter() - t)
            out[size] = {"host_tier_s": statistics.median(times)}
    finally:
        store.close()
    return out


def start_master(tmp: Path):
    master = MooncakeMaster(name="mooncake", kind="mooncake", args=[], run_dir=tmp / "run",
                            log_dir=tmp, binary=find_master_binary())
    master.start()
    master.wait_ready(time.monotonic() + 60)
    return master


def bench_remote(master_port: int, payloads: dict[int, bytes], reps: int) -> dict[int, dict]:
    """Reads of the entries the segcache server wrote behind to the store, from this process."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    # lazily, after the bind address is set (read at import), and an optional dependency
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    biggest = max(payloads) + MiB
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 2 * biggest, "tcp", "",
                   f"127.0.0.1:{master_port}") != 0:
        raise RuntimeError("mooncake setup failed")
    out: dict[int, dict] = {}
    try:
        keys = [f"bench-{size}" for size in payloads]
        deadline = time.monotonic() + 60
        while sum(r == 1 for r in store.batch_is_exist(keys)) < len(keys):  # the write-behind
            if time.monotonic() > deadline:
                raise RuntimeError("the segcache's entries did not reach the store in 60 s")
            time.sleep(0.1)
        for size, data in payloads.items():
            key = f"bench-{size}"
            n = store.get_size(key)
            buf = np.ones(n, dtype=np.uint8)  # pre-faulted
            if store.register_buffer(buf.ctypes.data, n) != 0:
                raise RuntimeError("register_buffer failed")
            entry = unpack(key, store.get(key))
            assert entry is not None and entry.data.tobytes() == data
            assert store.get_into(key, buf.ctypes.data, n) == n
            assert unpack(key, buf.tobytes()).data.tobytes() == data
            into, tier = [], []
            for _ in range(reps):
                t = time.perf_counter()
                store.get_into(key, buf.ctypes.data, n)
                into.append(time.perf_counter() - t)
                t = time.perf_counter()
                unpack(key, store.get(key))
                tier.append(time.perf_counter() - t)
            store.unregister_buffer(buf.ctypes.data)
            out[size] = {"mooncake_get_into_s": statistics.median(into),
                         "remote_tier_s": statistics.median(tier)}
    finally:
        store.close()
    return out


COLUMNS = [("memcpy", "memcpy_s"), ("host tier", "host_tier_s"), ("lmdb warm", "lmdb_warm_s"),
           ("lmdb cold", "lmdb_cold_s"), ("mc get_into", "mooncake_get_into_s"),
           ("remote tier", "remote_tier_s"), ("grpc 1MiB", "grpc_1mib_s"),
           ("grpc 4MiB", "grpc_4mib_s"), ("nixl", "nixl_s"), ("nixl+verify", "nixl_verify_s")]


def measure(sizes: list[int], payloads: dict[int, bytes], args) -> tuple[dict, dict, dict, dict, str]:
    """Every tier's reads: (through the service, LMDB in process, host tier in process, Mooncake,
    why Mooncake was not measured or "")."""
    why_no_remote = "--no-remote" if args.no_remote else mooncake_missing()
    if why_no_remote:
        print(f"no Mooncake tier: {why_no_remote}")
    remote: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="segcache-bench-") as td:
        tmp = Path(td)
        master = None if why_no_remote else start_master(tmp)
        # The store holds every entry (segment) and its client buffer passes the biggest one.
        remote_flags = [] if master is None else [
            "--remote-url", master.url, "--remote-segment-bytes", str(2 * sum(sizes) + 64 * MiB),
            "--remote-buffer-bytes", str(max(sizes) + 16 * MiB)]
        try:
            proc, port = start_server(tmp, 4 * sum(sizes) + 64 * MiB, remote_flags)
            try:
                svc = run_loop(lambda: bench_service(port, payloads, args.reps))  # uvloop if present
                if master is not None:
                    remote = bench_remote(master.port, payloads, args.reps)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        finally:
            if master is not None:
                master.stop(5)
        disk = bench_lmdb(tmp, payloads, args.reps)
        host = bench_host(tmp, payloads, args.reps)
    return svc, disk, host, remote, why_no_remote


def table(sizes: list[int], reads: dict[int, dict], reps: int) -> list[dict]:
    """Per size, seconds and GB/s of every column measured; printed as a table."""
    rows = []
    for size in sizes:
        r = reads[size]
        row = {"size_bytes": size}
        for name, k in COLUMNS:
            if k in r:
                row[k.replace("_s", "_gbps")] = round(gbps(size, r[k]), 3)
                row[k] = round(r[k], 6)
        rows.append(row)

    head = f"{'size':>8} " + " ".join(f"{n:>12}" for n, _ in COLUMNS)
    print("GB/s (10^9 bytes/s), median of", reps)
    print(head)
    for row in rows:
        cells = []
        for _, k in COLUMNS:
            g = row.get(k.replace("_s", "_gbps"))
            cells.append(f"{g:>12.3f}" if g is not None else f"{'-':>12}")
        print(f"{row['size_bytes'] // MiB:>6}Mi " + " ".join(cells))
    return rows


def ratios_note(rows: list[dict], disk: dict, why_no_remote: str) -> tuple[dict, str]:
    """The largest size's ratios between tiers, and the sentence that reports them."""
    big = rows[-1]
    ratios = {}
    if "nixl_gbps" in big:
        ratios["nixl_over_memcpy"] = round(big["nixl_gbps"] / big["memcpy_gbps"], 3)
        ratios["nixl_over_grpc"] = round(big["nixl_gbps"] / max(big["grpc_1mib_gbps"], big["grpc_4mib_gbps"]), 2)
    ratios["grpc_over_memcpy"] = round(max(big["grpc_1mib_gbps"], big["grpc_4mib_gbps"]) / big["memcpy_gbps"], 3)
    lmdb_memcpy = gbps(big["size_bytes"], disk[big["size_bytes"]]["memcpy_lmdb_phase_s"])
    ratios["lmdb_warm_over_memcpy"] = round(big["lmdb_warm_gbps"] / lmdb_memcpy, 3)
    if "lmdb_cold_gbps" in big:
        ratios["lmdb_cold_over_memcpy"] = round(big["lmdb_cold_gbps"] / lmdb_memcpy, 3)
    ratios["host_tier_over_memcpy"] = round(big["host_tier_gbps"] / big["memcpy_gbps"], 3)
    if "remote_tier_gbps" in big:
        ratios["remote_tier_over_lmdb_warm"] = round(big["remote_tier_gbps"] / big["lmdb_warm_gbps"], 3)
        ratios["mooncake_get_into_over_grpc"] = round(
            big["mooncake_get_into_gbps"] / max(big["grpc_1mib_gbps"], big["grpc_4mib_gbps"]), 3)
    note = (f"At {big['size_bytes'] // MiB} MiB: "
            + ", ".join(f"{k.replace('_over_', '/')} = {v}" for k, v in ratios.items())
            + ". One 2-core machine: client and server share the cores; NIXL used UCX over "
              "loopback (cma/shared memory); lmdb and remote tier include checksum verification "
              "(common.engine.checksum); Mooncake moved the bytes over TCP on 127.0.0.1 from the "
              "segcache process's segment"
            + (f" (not measured: {why_no_remote})" if why_no_remote else "") + ".")
    return ratios, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,16,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "segcache.json")
    ap.add_argument("--no-remote", action="store_true", help="skip the Mooncake tier")
    ap.add_argument("--no-capacity", action="store_true", help="skip the hit-rate-vs-capacity curve")
    args = ap.parse_args(argv)
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    rng = np.random.default_rng(0)
    payloads = {n: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes}
    load_nixl()
    svc, disk, host, remote, why_no_remote = measure(sizes, payloads, args)
    reads = {size: {**svc[size], **disk[size], **host[size], **remote.get(size, {})} for size in sizes}
    rows = table(sizes, reads, args.reps)
    ratios, note = ratios_note(rows, disk, why_no_remote)
    print()
    print(note)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    result = {"bench": "segcache", "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                               "platform": platform.platform(),
                                               "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
              "reps": args.reps, "rows": rows, "ratios": ratios, "note": note,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not args.no_capacity:
        cap_args = argparse.Namespace(model="", corpus=400, doc_tokens=[128, 2048], k=[4, 32],
                                      zipf_s=1.0, max_prompt_tokens=4096, requests=3000,
                                      warm=500, seed=0)
        curve = cap.run(cap_args)
        print()
        print(cap.table(curve))
        (args.out.parent / "segcache_capacity.json").write_text(json.dumps(curve, indent=1) + "\n")
        cap.plot(curve, args.out.parent / "segcache_capacity.png")
        print(f"wrote {args.out.parent}/segcache_capacity.json, segcache_capacity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
