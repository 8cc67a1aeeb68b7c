"""segcache store: tiers, budgets, eviction policy, persistence, integrity (no gRPC)."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

from common.mesh.config import ConfigError, load_config, parse_int
from services.segcache.config import ENV_PREFIX, SegcacheConfig
from services.segcache.policy import GDSFPolicy, LRUPolicy
from services.segcache.lmdb_file import HEADER
from services.segcache.store import (TIER_DISK, TIER_HOST, TIER_MISS, CacheFull, ChecksumMismatch,
                                     EntryTooLarge, InvalidRequest, SegmentStore, checksum)

KiB = 1 << 10
MiB = 1 << 20


def make_store(tmp_path: Path, **kw) -> SegmentStore:
    kw.setdefault("lmdb_sync", False)
    kw.setdefault("host_bytes", 1 * MiB)
    kw.setdefault("disk_bytes", 4 * MiB)
    return SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", **kw))


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def lmdb_values(path: Path, store: SegmentStore | None = None) -> dict[bytes, bytes]:
    """Raw `data` values in LMDB (through the store's own env while it is open: LMDB allows
    one env per file per process)."""
    if store is not None:
        with store._lmdb.env.begin(db=store._lmdb.data_db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        db = env.open_db(b"data", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def check_accounting(s: SegmentStore) -> None:
    """Tier byte counters agree with what the index says each tier holds, and fit the budget."""
    with s._lock:
        host = sum(e.size for e in s._entries.values() if e.host is not None)
        disk = sum(e.stored_len for e in s._entries.values() if e.on_disk)
        assert s.host.bytes == host
        assert s.disk.bytes == disk
        assert s.host.bytes <= s.host.budget
        assert s.disk.bytes <= s.disk.budget


# ---- budgets -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["gdsf", "lru"])
def test_budgets_hold_over_1000_random_puts(tmp_path: Path, policy: str) -> None:
    rng = random.Random(1234)
    s = make_store(tmp_path, host_bytes=256 * KiB, disk_bytes=1 * MiB, policy=policy)
    truth: dict[str, bytes] = {}
    try:
        for i in range(1000):
            j = rng.randrange(1500)
            key = f"k{j:05d}"
            data = blob(1 + (j * 7919) % (48 * KiB), j)  # a key always maps to the same bytes
            res = s.put(key, data, recompute_cost_s=rng.random() * 2, token_count=i % 700,
                        pin=rng.random() < 0.01)
            if res.created:
                truth[key] = data
            for _ in range(rng.randint(0, 2)):
                k = rng.choice(list(truth))
                got = s.get(k)
                if got is not None:
                    assert got[1].tobytes() == truth[k]
            if rng.random() < 0.05:
                k = rng.choice(list(truth))
                s.pin([k], pinned=False)
            if rng.random() < 0.03:
                s.delete([rng.choice(list(truth))])
            check_accounting(s)
        st = s.stats()
        host, disk = st["tiers"][1], st["tiers"][2]
        assert 0 < host["peak_bytes"] <= 256 * KiB
        assert 0 < disk["peak_bytes"] <= 1 * MiB
        assert disk["evictions"] > 0 and host["evictions"] > 0
        # LMDB holds exactly the entries the index says are on disk, and they verify.
        vals = lmdb_values(tmp_path / "lmdb", s)
        assert sum(len(v) for v in vals.values()) == disk["bytes"]
        assert {k.decode() for k in vals} == set(s._entries)
        for k in vals:
            got = s.get(k.decode())
            assert got is not None and got[1].tobytes() == truth[k.decode()]
    finally:
        s.close()


# ---- eviction policy -----------------------------------------------------------------------
@pytest.mark.parametrize("policy,evicted", [("gdsf", "cheap1"), ("lru", "costly")])
def test_eviction_order_follows_policy(tmp_path: Path, policy: str, evicted: str) -> None:
    """Host tier holds three 1000-byte entries. `costly` (10 s to recompute) is the least
    recently used when a fourth arrives: LRU evicts it, GDSF evicts the cheap, older `cheap1`.
    The gdsf case is the test that fails under plain LRU."""
    s = make_store(tmp_path, host_bytes=3500, disk_bytes=1 * MiB, policy=policy)
    try:
        s.put("costly", blob(1000, 1), recompute_cost_s=10.0)
        s.put("cheap1", blob(1000, 2), recompute_cost_s=0.01)
        s.put("cheap2", blob(1000, 3), recompute_cost_s=0.01)
        s.put("new", blob(1000, 4), recompute_cost_s=0.01)
        tiers = {k: s.tier_of(k) for k in ("costly", "cheap1", "cheap2", "new")}
        assert tiers[evicted] == TIER_DISK, tiers
        assert sum(t == TIER_HOST for t in tiers.values()) == 3, tiers
        if policy == "gdsf":
            assert tiers["costly"] == TIER_HOST
    finally:
        s.close()


def test_gdsf_frequency_and_aging() -> None:
    p = GDSFPolicy()
    for k in "abc":
        p.add(k, 100, 1.0, 1)
    p.touch("a", 5)  # a is hit often: highest value
    assert p.order()[-1] == "a"
    assert p.pop_victim() == "b"  # equal value: the older record goes first
    assert p.inflation == pytest.approx(0.01)
    # Inflation ages out entries: a newcomer of the same cost/size now outranks an old one.
    p.add("d", 100, 1.0, 1)
    assert p.order()[0] == "c"
    lru = LRUPolicy()
    for k in "abc":
        lru.add(k, 1, 0.0, 1)
    lru.touch("a", 2)
    assert lru.order() == ["b", "c", "a"]


def test_gdsf_prefers_keeping_small_costly_entries(tmp_path: Path) -> None:
    """Value is cost per byte: a big entry with the same cost goes before a small one."""
    s = make_store(tmp_path, host_bytes=20 * KiB, disk_bytes=1 * MiB)
    try:
        s.put("small", blob(2 * KiB, 1), recompute_cost_s=1.0)
        s.put("big", blob(12 * KiB, 2), recompute_cost_s=1.0)
        s.put("next", blob(8 * KiB, 3), recompute_cost_s=1.0)
        assert s.tier_of("small") == TIER_HOST
        assert s.tier_of("big") == TIER_DISK
    finally:
        s.close()


def test_disk_eviction_removes_entry_everywhere(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_bytes=64 * KiB, disk_bytes=10 * KiB)
    try:
        for i in range(5):
            s.put(f"k{i}", blob(3 * KiB, i), recompute_cost_s=1.0)
        present = [k for k in (f"k{i}" for i in range(5)) if s.tier_of(k) != TIER_MISS]
        assert len(present) == 3
        assert s.disk.bytes <= 10 * KiB
        assert set(k.decode() for k in lmdb_values(tmp_path / "lmdb", s)) == set(present)
        check_accounting(s)
    finally:
        s.close()


def test_hit_on_disk_is_promoted(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_bytes=4 * KiB, disk_bytes=1 * MiB)
    try:
        s.put("a", blob(3 * KiB, 1), recompute_cost_s=1.0)
        s.put("b", blob(3 * KiB, 2), recompute_cost_s=1.0)
        assert s.tier_of("a") == TIER_DISK and s.tier_of("b") == TIER_HOST
        info, data = s.get("a")
        assert info.tier == TIER_DISK and data.tobytes() == blob(3 * KiB, 1)
        assert s.tier_of("a") == TIER_HOST and s.tier_of("b") == TIER_DISK
        st = s.stats()["tiers"]
        assert st[1]["promotions"] == 1 and st[2]["hits"] == 1 and st[1]["misses"] == 1
    finally:
        s.close()


def test_pinned_entries_are_never_evicted(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_bytes=8 * KiB, disk_bytes=8 * KiB + 2 * HEADER.size)
    try:
        s.put("p", blob(4 * KiB, 1), recompute_cost_s=0.0, pin=True)
        s.put("q", blob(4 * KiB, 2), recompute_cost_s=0.0)
        assert s.pin(["q", "missing"]) == (1, ["missing"])
        with pytest.raises(CacheFull):
            s.put("r", blob(1 * KiB, 3))
        assert s.tier_of("p") == TIER_HOST and s.tier_of("q") == TIER_HOST
        s.pin(["q"], pinned=False)
        s.put("r", blob(1 * KiB, 3))
        assert s.tier_of("q") == TIER_MISS and s.tier_of("p") == TIER_HOST
    finally:
        s.close()


# ---- bounds and validation ------------------------------------------------------------------
def test_bounds_and_validation(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_bytes=64 * KiB, disk_bytes=1 * MiB)
    try:
        with pytest.raises(EntryTooLarge):
            s.put("big", bytes(64 * KiB + 1))  # over the host budget
        with pytest.raises(InvalidRequest):
            s.put("", b"x")
        with pytest.raises(InvalidRequest):
            s.put("k" * 257, b"x")
        with pytest.raises(InvalidRequest):
            s.put("empty", b"")
        with pytest.raises(InvalidRequest):
            s.put("nan", b"x", recompute_cost_s=float("nan"))
        with pytest.raises(ChecksumMismatch):
            s.put("sum", b"abc", expected_checksum=checksum(b"abd"))
        assert s.put("sum", b"abc", expected_checksum=checksum(b"abc")).created
        assert s.stats()["entries"] == 1
    finally:
        s.close()


def test_concurrent_put_of_same_key_is_idempotent(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    results = []
    data = blob(200 * KiB, 7)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(s.put("same", data, recompute_cost_s=1.0))

    try:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sum(r.created for r in results) == 1 and len(results) == 8
        assert s.stats()["entries"] == 1
        assert s.get("same")[1].tobytes() == data
        check_accounting(s)
        # A later Put with different bytes keeps the first (and is counted).
        r = s.put("same", blob(10, 8))
        assert not r.created and r.info.checksum == checksum(data)
        assert s.stats()["put_conflicts"] == 1
    finally:
        s.close()


# ---- persistence and integrity -------------------------------------------------------------
def test_restart_finds_every_entry(tmp_path: Path) -> None:
    truth = {}
    s = make_store(tmp_path, host_bytes=64 * KiB, disk_bytes=4 * MiB)
    for i in range(60):
        key = os.urandom(16).hex()
        truth[key] = blob(1 + i * 997 % (40 * KiB), i)
        s.put(key, truth[key], recompute_cost_s=i / 10, token_count=i, model_fingerprint=f"fp{i}",
              pin=(i % 10 == 0))
    s.close()
    s = make_store(tmp_path, host_bytes=64 * KiB, disk_bytes=4 * MiB)
    try:
        assert s.stats()["entries"] == 60
        infos = s.lookup(list(truth))
        for i, (key, info) in enumerate(zip(truth, infos)):
            assert info is not None and info.tier == TIER_DISK
            assert info.token_count == i and info.model_fingerprint == f"fp{i}"
            assert info.recompute_cost_s == pytest.approx(i / 10)
            assert info.pinned == (i % 10 == 0)
            assert info.checksum == checksum(truth[key])
        for key, data in truth.items():
            assert s.get(key)[1].tobytes() == data
        check_accounting(s)
    finally:
        s.close()


def _corrupt(path: Path, key: str, how: str) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"data")
        with env.begin(write=True, db=db) as txn:
            v = bytearray(txn.get(key.encode()))
            if how == "payload":
                v[HEADER.size + len(v) // 3] ^= 0x5A
                v[-1] ^= 0x01
            elif how == "header":
                v[HEADER.size - 1] ^= 0xFF  # inside the stored digest
            elif how == "truncate":
                v = v[: len(v) - 100]
            elif how == "missing":
                txn.delete(key.encode())
                return
            txn.put(key.encode(), bytes(v))
    finally:
        env.close()


@pytest.mark.parametrize("how", ["payload", "header", "truncate", "missing"])
def test_corrupt_value_is_a_miss_and_dropped(tmp_path: Path, how: str) -> None:
    s = make_store(tmp_path)
    s.put("victim", blob(50 * KiB, 1), recompute_cost_s=1.0)
    s.put("bystander", blob(50 * KiB, 2), recompute_cost_s=1.0)
    s.close()
    _corrupt(tmp_path / "lmdb", "victim", how)
    s = make_store(tmp_path)
    try:
        assert s.lookup(["victim"])[0].tier == TIER_DISK  # lookup does not read the bytes
        assert s.get("victim") is None  # the read verifies: a miss, never the bad bytes
        assert s.lookup(["victim"]) == [None]
        assert s.stats()["corrupt_dropped"] == 1
        assert s.get("bystander")[1].tobytes() == blob(50 * KiB, 2)
        check_accounting(s)
    finally:
        s.close()
    assert set(lmdb_values(tmp_path / "lmdb")) == {b"bystander"}


def test_corrupt_value_is_never_leased(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    s.put("victim", blob(10 * KiB, 1))
    s.close()
    _corrupt(tmp_path / "lmdb", "victim", "payload")
    s = make_store(tmp_path)
    try:
        assert s.acquire_host("victim") is None
        assert s.lookup(["victim"]) == [None]
    finally:
        s.close()


# ---- leases --------------------------------------------------------------------------------
def test_lease_pins_entry_and_outlives_delete(tmp_path: Path) -> None:
    s = make_store(tmp_path, host_bytes=8 * KiB, disk_bytes=1 * MiB)
    try:
        s.put("a", blob(4 * KiB, 1), recompute_cost_s=0.0)
        lease = s.acquire_host("a")
        assert lease is not None and not lease.staged
        s.put("b", blob(4 * KiB, 2), recompute_cost_s=5.0)
        s.put("c", blob(4 * KiB, 3), recompute_cost_s=5.0)  # must evict b, not the leased a
        assert s.tier_of("a") == TIER_HOST and s.tier_of("b") == TIER_DISK
        assert s.delete(["a"]) == 1
        assert s.tier_of("a") == TIER_MISS
        assert lease.buf.tobytes() == blob(4 * KiB, 1)  # still intact for the reader
        assert s.host.bytes == 8 * KiB  # a's buffer still counted until the lease ends
        s.release_host(lease)
        assert s.host.bytes == 4 * KiB and s.leases_active == 0
        check_accounting(s)
    finally:
        s.close()


def test_lease_from_disk_promotes(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    s.put("a", blob(4 * KiB, 1))
    s.close()
    s = make_store(tmp_path)
    try:
        lease = s.acquire_host("a")
        assert lease is not None and s.tier_of("a") == TIER_HOST
        assert lease.buf.tobytes() == blob(4 * KiB, 1)
        s.release_host(lease)
    finally:
        s.close()


def test_write_behind_mode(tmp_path: Path) -> None:
    s = make_store(tmp_path, write_through=False)
    for i in range(20):
        s.put(f"k{i}", blob(1000 + i, i))
    assert s.get("k3")[1].tobytes() == blob(1003, 3)
    s.flush()
    assert s.stats()["pending_writes"] == 0
    s.close()
    s = make_store(tmp_path)
    try:
        assert s.stats()["entries"] == 20
        assert s.get("k19")[1].tobytes() == blob(1019, 19)
    finally:
        s.close()


# ---- config ----------------------------------------------------------------------------------
def test_config_flags_env_defaults(tmp_path: Path) -> None:
    env = {ENV_PREFIX + "HOST_BYTES": "2MiB", ENV_PREFIX + "POLICY": "lru",
           ENV_PREFIX + "LMDB_SYNC": "false", ENV_PREFIX + "PORT": "1234"}
    cfg = load_config(SegcacheConfig, ["--port", "0", "--data-dir", str(tmp_path), "--no-nixl"],
                      env=env, env_prefix=ENV_PREFIX)
    assert cfg.port == 0  # flag beats env
    assert cfg.host_bytes == 2 * MiB and cfg.policy == "lru" and cfg.lmdb_sync is False
    assert cfg.nixl is False and cfg.data_dir == tmp_path
    assert cfg.host == "127.0.0.1" and cfg.disk_bytes == SegcacheConfig().disk_bytes
    assert parse_int("1_000") == 1000 and parse_int("4k") == 4000 and parse_int("1GiB") == 1 << 30
    with pytest.raises(ConfigError):
        load_config(SegcacheConfig, [], env={ENV_PREFIX + "HOST_BYTES": "lots"}, env_prefix=ENV_PREFIX)
    with pytest.raises(ConfigError):
        load_config(SegcacheConfig, ["--policy", "fifo"], env={}, env_prefix=ENV_PREFIX)
    with pytest.raises(SystemExit):
        load_config(SegcacheConfig, ["--port", "x"], env={}, env_prefix=ENV_PREFIX)


# ---- tier 0 (device) -----------------------------------------------------------------------
def test_device_tier_logic_with_a_cpu_stand_in(tmp_path: Path) -> None:
    """Tier 0 only runs with CUDA; its promotion/demotion logic is exercised here with CPU
    tensors standing in for device memory."""
    torch = pytest.importorskip("torch")
    from services.segcache.policy import make_policy
    from services.segcache.store import TIER_DEVICE, TierState

    s = make_store(tmp_path, host_bytes=2500, disk_bytes=1 * MiB)
    try:
        assert not s.device.enabled  # no CUDA here: the tier is off by default
        s._torch, s._cuda = torch, torch.device("cpu")
        s.device = TierState(TIER_DEVICE, 2500, True, make_policy("gdsf"))
        s.tiers = (s.device, s.host, s.disk)
        for i, k in enumerate("abc"):
            s.put(k, blob(1000, i), recompute_cost_s=1.0)
        # New entries go to tier 0; the oldest equal-value one was demoted to host.
        assert [s.tier_of(k) for k in "abc"] == [TIER_HOST, TIER_DEVICE, TIER_DEVICE]
        info, data = s.get("a")  # host hit: answered from host, then promoted to device
        assert info.tier == TIER_HOST and data.tobytes() == blob(1000, 0)
        assert s.tier_of("a") == TIER_DEVICE
        assert sorted(s.tier_of(k) for k in "abc") == [TIER_DEVICE, TIER_DEVICE, TIER_HOST]
        info, data = s.get("a")
        assert info.tier == TIER_DEVICE and data.tobytes() == blob(1000, 0)
        with s._lock:  # exclusive memory tiers, consistent accounting
            for e in s._entries.values():
                assert not (e.host is not None and e.device is not None)
            assert s.device.bytes == sum(e.size for e in s._entries.values() if e.device is not None)
        check_accounting(s)
        lease = s.acquire_host("a")  # a device-resident entry is leased through a host copy
        assert lease.staged and lease.buf.tobytes() == blob(1000, 0)
        s.release_host(lease)
        assert s.staging_bytes == 0 and s.leases_active == 0
        st = s.stats()["tiers"][0]
        assert st["enabled"] and st["promotions"] == 1 and st["evictions"] >= 2
    finally:
        s.close()


def test_delete_and_pin_tolerate_duplicates_and_misses(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    try:
        s.put("a", blob(100, 1))
        s.put("b", blob(100, 2))
        assert s.pin(["a", "a", "zz"]) == (1, ["zz"])
        assert s.delete(["a", "a", "zz"]) == 1
        assert s.delete(["a"]) == 0
        assert s.stats()["entries"] == 1 and s.stats()["pinned"] == 0
        check_accounting(s)
    finally:
        s.close()


def test_shrunk_disk_budget_is_enforced_at_start(tmp_path: Path) -> None:
    s = make_store(tmp_path, disk_bytes=1 * MiB)
    for i in range(10):
        s.put(f"k{i}", blob(10 * KiB, i), recompute_cost_s=float(i))
    s.close()
    s = make_store(tmp_path, disk_bytes=5 * (10 * KiB + HEADER.size))
    try:
        assert s.stats()["entries"] == 5
        assert sorted(k for k in s._entries) == [f"k{i}" for i in range(5, 10)]  # GDSF kept the costly
        assert s.disk.peak <= s.disk.budget
        check_accounting(s)
    finally:
        s.close()
