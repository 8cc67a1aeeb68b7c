"""segcache knows each entry's storage format from the entry's own header: bytes and entries per
tier per format in its metrics (unknown formats and bytes that are no entry count as "other"),
equal to the tier totals, and kept across a restart (the LMDB meta record's format byte; records
written before it have their format read back from the entry header)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, generate_latest

from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry
from common.engine.pic.seal import header_of, seal
from services.segcache import lmdb_file
from services.segcache.config import SegcacheConfig
from services.segcache.metrics import StoreCollector
from services.segcache.records import FORMAT_LABELS, entry_format, format_totals
from services.segcache.store import SegmentStore

MiB = 1 << 20


def real_entry(fmt: str, seed: int, n: int = 12) -> bytes:
    """Sealed bytes of a SegmentEntry (one matrix-form linear layer and one attention layer) stored
    in `fmt`: the header exactly as the engine writes it (fp8: version 5, keys and values in e4m3)."""
    g = torch.Generator().manual_seed(seed)
    body = LinearBody(T=torch.randn(1, 2, 8, 8, generator=g), form="matrix", S=torch.randn(1, 2, 8, 8, generator=g),
                      conv_tail=None, warmup_inputs=None)
    ids = torch.randint(0, 1000, (n,), generator=g).tolist()
    # a few keys and values only: the tests size their tiers by the linear part's bytes
    kv = AttentionBody(torch.randn(1, 1, 2, 4, generator=g), torch.randn(1, 1, 2, 4, generator=g))
    e = SegmentEntry(ids, 4, "ab" * 32, "float32", [body, kv]).with_format(fmt)
    return seal(e.to_bytes(), b"")


def hand_entry(header: dict) -> bytes:
    hb = json.dumps(header).encode()
    return b"HYPE" + struct.pack("<I", len(hb)) + hb + b"\0" * 64


def scrape(store: SegmentStore) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_entry_format_reads_the_header():
    for fmt in ("fp32", "bf16", "fp8t", "fp8"):
        assert entry_format(real_entry(fmt, 1)) == fmt
    assert header_of(real_entry("fp8", 1))["version"] == 5  # K/V in e4m3: still read as fp8
    assert entry_format(hand_entry({"version": 1})) == "fp32"  # before formats existed
    assert entry_format(hand_entry({"version": 2})) == "fp32"
    assert entry_format(hand_entry({"version": 3, "format": "fp4"})) == "other"  # bounded label
    assert entry_format(hand_entry({"version": 3, "format": ["bf16"]})) == "other"
    assert entry_format(hand_entry({"version": 9})) == "other"
    assert entry_format(hand_entry({"version": 2, "format": "bf16"})) == "fp32"  # as entry.py reads it
    assert entry_format(b"not an entry at all") == "other"
    assert entry_format(b"HYPE\xff\xff\xff\xff") == "other"


def test_metrics_split_each_tier_by_format_and_add_up(tmp_path: Path, fresh_seed):
    rng = random.Random(fresh_seed)
    cfg = SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, host_bytes=12 << 10, disk_bytes=4 * MiB)
    store = SegmentStore(cfg)
    fmts = {}
    try:
        for i in range(30):  # more than the host tier holds: evictions move entries out of it
            fmt = rng.choice(["fp32", "bf16", "fp8t", "fp8", "junk"])
            data = real_entry(fmt, i, n=rng.randrange(4, 200)) if fmt != "junk" else rng.randbytes(3000)
            fmts[f"k{i}"] = "other" if fmt == "junk" else fmt
            store.put(f"k{i}", data, recompute_cost_s=rng.random())
        m = scrape(store)
        for t in store.stats()["tiers"]:
            if not t["enabled"]:
                continue
            per = [m[f'hypic_segcache_format_bytes{{format="{f}",tier="{t["name"]}"}}'] for f in FORMAT_LABELS]
            n = [m[f'hypic_segcache_format_entries{{format="{f}",tier="{t["name"]}"}}'] for f in FORMAT_LABELS]
            assert sum(per) == t["bytes"] and sum(n) == t["entries"], t["name"]
        disk = {f: m[f'hypic_segcache_format_entries{{format="{f}",tier="disk"}}'] for f in FORMAT_LABELS}
        assert disk == {f: sum(1 for v in fmts.values() if v == f) for f in FORMAT_LABELS}
        host = store.stats()["tiers"][1]
        assert 0 < host["entries"] < len(fmts)  # the host tier holds a subset: the split is per tier
        before = store.stats()["formats"]
        store.delete(["k0", "k1"])
        after = store.stats()["formats"]
        assert sum(v[1] for (t, _), v in after.items() if t == "disk") == len(fmts) - 2
        assert before != after
    finally:
        store.close()
    reopened = SegmentStore(cfg)  # the format byte of the meta record
    try:
        assert {k: v for k, v in reopened.stats()["formats"].items() if k[0] == "disk"} == \
            {k: v for k, v in after.items() if k[0] == "disk"}
    finally:
        reopened.close()


def test_records_without_the_format_byte_read_it_from_the_header(tmp_path: Path, monkeypatch):
    cfg = SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, host_bytes=1 * MiB, disk_bytes=4 * MiB)
    store = SegmentStore(cfg)
    # a segcache before the format byte wrote 0 there
    monkeypatch.setattr(lmdb_file, "FORMAT_CODES", {"other": 0})
    try:
        store.put("a", real_entry("bf16", 1))
        store.put("b", real_entry("fp8", 2))
        store.put("c", b"junk" * 100)
    finally:
        store.close()
    monkeypatch.undo()
    f = lmdb_file.LmdbFile(cfg)
    try:
        entries = f.load_index()[0]
        assert {e.key: e.format for e in entries} == {"a": "bf16", "b": "fp8", "c": "other"}
    finally:
        f.close()
    reopened = SegmentStore(cfg)
    try:
        assert reopened.stats()["formats"][("disk", "bf16")][1] == 1
    finally:
        reopened.close()


def _nonzero(totals: dict) -> dict:
    return {k: list(v) for k, v in totals.items() if v != [0, 0]}


def test_kept_counts_equal_a_scan_of_the_index_under_random_operations(tmp_path: Path, fresh_seed):
    """TierState.formats (kept as entries come and go) against format_totals (a scan of the index):
    equal after every put, read (promotions), eviction, delete, pin and unpin, and after a restart."""
    rng = random.Random(fresh_seed)
    cfg = SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, host_bytes=12 << 10, disk_bytes=40 << 10)
    entries = {}
    for i in range(24):
        fmt = rng.choice(["fp32", "bf16", "fp8t", "fp8", "junk"])
        entries[f"k{i}"] = real_entry(fmt, i, n=rng.randrange(4, 300)) if fmt != "junk" else rng.randbytes(5000)
    store = SegmentStore(cfg)
    try:
        for step in range(300):
            key = rng.choice(list(entries))
            op = rng.random()
            if op < 0.45:
                store.put(key, entries[key], recompute_cost_s=rng.random())
            elif op < 0.8:
                store.get(key)
            elif op < 0.9:
                store.delete([key])
            else:
                store.pin([key], rng.random() < 0.5)
            with store._lock:
                assert _nonzero(store.stats()["formats"]) == _nonzero(format_totals(store._entries.values())), step
        assert store.stats()["tiers"][2]["evictions"] > 0 and store.stats()["tiers"][1]["evictions"] > 0
        before = _nonzero(store.stats()["formats"])
    finally:
        store.close()
    reopened = SegmentStore(cfg)
    try:
        after = _nonzero(reopened.stats()["formats"])
        assert after == {k: v for k, v in before.items() if k[0] == "disk"}
    finally:
        reopened.close()
