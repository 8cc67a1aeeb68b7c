"""The shared remote tier (Mooncake Store): object format and URL parsing, then a real
`mooncake_master` on 127.0.0.1 with two segcache processes (two "boxes", each its own LMDB):
an entry put through A is a hit through B, corrupt bytes in the store are a miss, and a master
killed mid-load fails no call."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.mesh.segcache_client import SegcacheClient
from hypic.launcher import find_master_binary, mooncake_missing
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.segcache.records import checksum
from services.segcache.remote_tier import pack, parse_remote_url, unpack
from tests.support.segcache_process import SegcacheProcess

pytestmark = pytest.mark.timeout(300)
MASTER = find_master_binary()


def _blob(rng: random.Random, n: int) -> np.ndarray:
    return np.frombuffer(rng.randbytes(n), dtype=np.uint8)


def test_parse_remote_url():
    assert parse_remote_url("mooncake://127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_remote_url(" mooncake://master.local:1/ ") == ("master.local", 1)
    for bad in ("", "127.0.0.1:5", "redis://h:1", "mooncake://h", "mooncake://h:0",
                "mooncake://h:70000", "mooncake://h:x", "mooncake://:5", "mooncake://h:5/path",
                "mooncake://u@h:5", "mooncake://h:5?q=1"):
        with pytest.raises(ValueError):
            parse_remote_url(bad)


def test_object_roundtrip_and_every_bad_object_is_a_miss(fresh_seed):
    rng = random.Random(fresh_seed)
    data = _blob(rng, rng.randrange(1, 20000))
    obj = pack("k", data, recompute_cost_s=0.7, token_count=9, model_fingerprint="fp",
               digest=checksum(data))
    e = unpack("k", obj)
    assert e is not None and np.array_equal(e.data, data) and e.token_count == 9
    assert unpack("other-key", obj) is None  # a foreign object under our key
    assert unpack("k", b"") is None  # a vanished writer's object reads as b""
    assert unpack("k", obj[:-1]) is None
    flipped = bytearray(obj)
    flipped[-1 - rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    assert unpack("k", bytes(flipped)) is None
    assert unpack("k", rng.randbytes(len(obj))) is None


def test_no_master_means_an_absent_tier_fast(fresh_seed):
    from services.segcache.remote_tier import MooncakeTier, RemoteCollector
    rng = random.Random(fresh_seed)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = MooncakeTier(f"mooncake://127.0.0.1:{port}", health_period_s=0.05)
    try:
        time.sleep(0.2)
        data = _blob(rng, 100)
        t = time.monotonic()
        assert not tier.available
        assert not tier.enqueue("k", data, recompute_cost_s=0.0, token_count=1,
                                model_fingerprint="", digest=checksum(data))
        assert tier.exists(["k"]) == set() and tier.get("k") is None
        assert time.monotonic() - t < 0.1
        metrics = {m.name: m for m in RemoteCollector(tier).collect()}
        assert metrics["hypic_segcache_remote_up"].samples[0].value == 0
        dropped = [x for x in metrics["hypic_segcache_remote_ops"].samples if x.labels["outcome"] == "dropped"]
        assert dropped[0].value == 1
    finally:
        tier.close()


# ---- a real master and two segcache processes ----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.log = tmp / "master.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self) -> "Master":
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([MASTER, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1"],
                                         env=env, stdout=log, stderr=log)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(self.log.read_text(errors="replace"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def boxes(tmp_path: Path):
    missing = mooncake_missing()
    if missing:
        pytest.skip(missing)
    master = Master(tmp_path).start()
    procs = []
    try:
        for name in ("a", "b"):
            d = tmp_path / name
            d.mkdir()
            procs.append(SegcacheProcess(d, ["--remote-url", master.url], name).start())
        yield master, procs[0], procs[1]
    finally:
        for p in procs:
            p.kill()
        master.kill()


async def _until(pred, timeout: float = 20.0, step: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(step)
    raise AssertionError("condition not met in time")


@pytest.mark.processes
def test_entry_put_through_a_is_a_hit_through_b_and_corrupt_bytes_are_a_miss(boxes, fresh_seed):
    master, a, b = boxes
    rng = random.Random(fresh_seed)
    keys = [f"seg-{rng.getrandbits(48):x}" for _ in range(4)]
    blobs = {k: rng.randbytes(rng.randrange(1000, 300_000)) for k in keys}

    async def run():
        async with SegcacheClient(a.target, timeout_s=10) as ca, SegcacheClient(b.target, timeout_s=10) as cb:
            async def b_sees_all():
                infos = await cb.lookup(keys)
                return all(i.tier == segcache_pb.TIER_REMOTE for i in infos)
            assert all(i.tier == segcache_pb.TIER_MISS for i in await cb.lookup(keys))
            for k in keys:
                await ca.put(k, blobs[k], token_count=5, recompute_cost_s=0.25)
            await _until(b_sees_all)  # written behind to the store, seen by B's batched is_exist
            for k in keys:
                info, data = await cb.get_with_info(k)  # read, verified, promoted into B
                assert bytes(data) == blobs[k] and info.token_count == 5
                assert info.tier == segcache_pb.TIER_REMOTE
            assert all(i.tier == segcache_pb.TIER_HOST for i in await cb.lookup(keys))

            # Garbage under a key in the store: B never serves it.
            from mooncake.store import MooncakeDistributedStore
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                               f"127.0.0.1:{master.port}") == 0
            bad_key, bad_data = f"seg-{rng.getrandbits(48):x}", _blob(rng, 5000)
            good = pack(bad_key, bad_data, recompute_cost_s=0.1, token_count=1,
                        model_fingerprint="", digest=checksum(bad_data))
            corrupt = bytearray(good)
            corrupt[-1 - rng.randrange(5000)] ^= 0xFF
            assert store.put(bad_key, bytes(corrupt)) == 0
            garbage_key = f"seg-{rng.getrandbits(48):x}"
            assert store.put(garbage_key, rng.randbytes(3000)) == 0
            for k in (bad_key, garbage_key):
                assert await cb.get(k) is None  # NOT_FOUND: a miss, never the bytes
            assert all(i.tier != segcache_pb.TIER_HOST for i in await cb.lookup([bad_key, garbage_key]))
            store.close()

    asyncio.run(run())


@pytest.mark.processes
def test_master_killed_mid_load_fails_no_call(boxes, fresh_seed):
    master, a, b = boxes
    rng = random.Random(fresh_seed)
    keys = [f"seg-{rng.getrandbits(48):x}" for _ in range(40)]
    blobs = {k: rng.randbytes(rng.randrange(1000, 50_000)) for k in keys}

    async def run():
        async with SegcacheClient(a.target, timeout_s=15) as ca, SegcacheClient(b.target, timeout_s=15) as cb:
            for k in keys:
                await ca.put(k, blobs[k], token_count=1)
            failures, served, missed = [], 0, 0
            killed_at = None
            t_end = time.monotonic() + 8
            i = 0
            while time.monotonic() < t_end:
                if killed_at is None and i == 10:
                    master.kill()
                    killed_at = time.monotonic()
                k = keys[i % len(keys)]
                i += 1
                try:
                    await cb.lookup([k])
                    got = await cb.get(k)
                    if got is None:
                        missed += 1
                    else:
                        assert bytes(got) == blobs[k]
                        served += 1
                    await ca.put(f"{k}-{i}", blobs[k], token_count=1)  # write-behind, master gone
                except grpc.aio.AioRpcError as e:
                    failures.append(e.code().name)
            # After the health check notices, calls do not wait on the dead master.
            t = time.monotonic()
            infos = await cb.lookup(keys[-5:] + ["never"])
            assert infos[-1].tier == segcache_pb.TIER_MISS
            assert time.monotonic() - t < 1.0
            print(f"[remote] served {served} missed {missed} after kill at call 10; failures {failures}")
            assert not failures
            assert a.alive() and b.alive()

    asyncio.run(run())


@pytest.mark.processes
def test_malformed_remote_url_exits_2(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_SEGCACHE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    r = subprocess.run([sys.executable, "-m", "services.segcache", "--data-dir", str(tmp_path),
                        "--remote-url", "mooncake://nohost"], env=env, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"remote_url" in r.stderr


# ---- the address a segcache gives Mooncake as its own (--advertise-host) -------------------------
def test_advertise_host_defaults_to_host_and_a_wildcard_needs_one(tmp_path: Path):
    from services.segcache.config import SegcacheConfig
    url = "mooncake://master:50051"
    assert SegcacheConfig(data_dir=tmp_path, remote_url=url).remote_local_host == "127.0.0.1"
    assert SegcacheConfig(data_dir=tmp_path, host="10.1.2.3", remote_url=url).remote_local_host == "10.1.2.3"
    for wildcard in ("0.0.0.0", "::", "[::]"):
        with pytest.raises(ValueError, match="advertise_host"):
            SegcacheConfig(data_dir=tmp_path, host=wildcard, remote_url=url)
        cfg = SegcacheConfig(data_dir=tmp_path, host=wildcard, remote_url=url, advertise_host=" segcache ")
        assert cfg.remote_local_host == "segcache"
        assert SegcacheConfig(data_dir=tmp_path, host=wildcard).remote_url == ""  # no tier: no need
        with pytest.raises(ValueError, match="advertise_host"):  # a wildcard is never dialable
            SegcacheConfig(data_dir=tmp_path, remote_url=url, advertise_host=wildcard)


@pytest.mark.processes
def test_wildcard_host_with_remote_tier_and_no_advertise_host_exits_2(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_SEGCACHE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    r = subprocess.run([sys.executable, "-m", "services.segcache", "--data-dir", str(tmp_path),
                        "--host", "0.0.0.0", "--port", "0", "--remote-url", "mooncake://127.0.0.1:1"],
                       env=env, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"advertise_host" in r.stderr


@pytest.mark.processes
def test_advertised_name_is_the_segment_peers_reach(tmp_path: Path, fresh_seed):
    """A segcache advertising `localhost` mounts its Mooncake segment under that name, and an
    entry put through it is read through another segcache."""
    missing = mooncake_missing()
    if missing:
        pytest.skip(missing)
    rng = random.Random(fresh_seed)
    master = Master(tmp_path).start()
    procs = []
    try:
        for name, extra in (("a", ["--advertise-host", "localhost"]), ("b", [])):
            (tmp_path / name).mkdir()
            procs.append(SegcacheProcess(tmp_path / name, ["--remote-url", master.url, *extra], name).start())
        a, b = procs
        key, blob = f"seg-{rng.getrandbits(48):x}", rng.randbytes(rng.randrange(1000, 200_000))

        async def run():
            async with SegcacheClient(a.target, timeout_s=10) as ca, \
                    SegcacheClient(b.target, timeout_s=10) as cb:
                async def mounted():  # A's tier connects in the background
                    return "segment_name=localhost:" in master.log.read_text(errors="replace")
                await _until(mounted)
                await ca.put(key, blob, token_count=3, recompute_cost_s=0.1)

                async def b_sees_it():
                    return (await cb.lookup([key]))[0].tier == segcache_pb.TIER_REMOTE
                await _until(b_sees_it)
                _, data = await cb.get_with_info(key)
                assert bytes(data) == blob
        asyncio.run(run())
    finally:
        for p in procs:
            p.kill()
        master.kill()
