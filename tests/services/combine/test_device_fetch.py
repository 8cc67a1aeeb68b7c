"""The combine's side of the same-GPU read (services/combine/device_fetch.py), on CPU.

The servicer and client are real; what CUDA would do is stood in for (tests/support/device_tier.py):
tier 0 on a CPU device, and an IPC export/open pair that hands the buffer over within this process.
So every line of the combine's path runs — the Get with a place, the device lease, the parse from
the "device" bytes, the plan check, the placement, the release — except the CUDA copy itself
(scripts/gpu_tier.py's "combine fetch over CUDA IPC" row). With the real open_ipc, which refuses
off CUDA, the read must fall back to the host path: counted, the lease released, no wait.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.entry import EntryMismatch, SegmentEntry
from common.engine.pic.placement import entry_placement
from common.engine.pic.seal import seal
from common.mesh.segcache_client import SegcacheClient
from common.mesh.transfer_path import box_id
from services.combine import device_fetch
from services.combine.device_fetch import IPC_READS, fetch_at_place, reader_place
from tests.support.device_tier import GPU, place, serve, stand_in_open, stand_in_servicer
from tests.support.segcache_process import arun
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 4
SECRET = b"device-fetch-test-secret"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=3, **PIC_CONFIGS["qwen3_next"])
    return HybridEngine.from_pretrained(path, dtype=torch.bfloat16)


@pytest.fixture
def served(tmp_path: Path):
    yield from stand_in_servicer(tmp_path, lease_ttl_s=30.0)


def test_off_cuda_a_combine_sends_no_place() -> None:
    assert reader_place("cpu", sealed=True) is None


def _read(servicer, engine_like, key: str, data: bytes, ids: list[int], check) -> tuple:
    async def run():
        server, target = await serve(servicer)
        background: list[asyncio.Task] = []
        try:
            async with SegcacheClient(target) as sc:
                await sc.put(key, data)
                hit = await fetch_at_place(sc, key, place(box_id(), GPU), engine_like, check, request_id="rid",
                                           timeout=10.0, spawn=lambda c: background.append(asyncio.create_task(c)))
                await asyncio.gather(*background)
                away = await fetch_at_place(sc, key, place("another-box", GPU), engine_like, check,
                                            request_id="rid", timeout=10.0, spawn=lambda c: None)
                miss = await fetch_at_place(sc, "f" * 64, place(box_id(), GPU), engine_like, check,
                                            request_id="rid", timeout=10.0, spawn=lambda c: None)
                return hit, away, miss, servicer.store.leases_active
        finally:
            await server.stop(None)
    return arun(run())


def _entry(engine, seed: int) -> tuple[list[int], SegmentEntry, bytes]:
    ids = torch.randint(0, engine.vocab_size, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    entry = engine.build_entry(ids, SEAM)
    return ids, entry, seal(entry.to_bytes(), SECRET)


def test_an_ipc_answer_becomes_the_placed_entry_and_its_lease_is_released(served, engine, monkeypatch, fresh_seed):
    servicer, store = served
    monkeypatch.setattr(device_fetch, "open_ipc", stand_in_open)
    ids, built, data = _entry(engine, fresh_seed)
    before = IPC_READS.labels("ok")._value.get()
    hit, away, miss, leases = _read(servicer, engine, built.key, data, ids,
                                    lambda e: engine.check_entry(e, ids, SEAM))
    assert hit.entry is not None and hit.data is None and leases == 0
    assert IPC_READS.labels("ok")._value.get() == before + 1
    assert hit.entry.key == built.key
    want = SegmentEntry.from_bytes(built.to_bytes())
    for (name, dev, dt), (_, _, wdt) in zip(entry_placement(hit.entry), entry_placement(want)):
        assert dev == engine.device
        assert dt == (torch.float32 if name.split(".")[1] in ("T", "S") else engine.dtype), name
    for g, w in zip(hit.entry.layers, want.layers):
        if hasattr(g, "T"):
            assert torch.equal(g.T, w.T.float()) and torch.equal(g.S, w.S.float())
    assert away.entry is None and bytes(away.data) == data  # another box: the bytes
    assert miss is None


def test_a_failed_ipc_read_falls_back_and_releases_its_lease(served, engine, fresh_seed):
    servicer, store = served
    ids, built, data = _entry(engine, fresh_seed)
    cuda_reader = SimpleNamespace(device=torch.device("cuda", 0), dtype=engine.dtype)  # open_ipc refuses off CUDA
    before = IPC_READS.labels("fallback")._value.get()
    hit, _, _, leases = _read(servicer, cuda_reader, built.key, data, ids, lambda e: None)
    assert hit is not None and hit.entry is None and hit.data is None and hit.info.size == len(data)
    assert IPC_READS.labels("fallback")._value.get() == before + 1 and leases == 0


def test_an_entry_that_does_not_fit_the_plan_falls_back(served, engine, monkeypatch, fresh_seed):
    servicer, store = served
    monkeypatch.setattr(device_fetch, "open_ipc", stand_in_open)
    ids, built, data = _entry(engine, fresh_seed)
    other = [(t + 1) % engine.vocab_size for t in ids]

    def check(e):
        engine.check_entry(e, other, SEAM)

    with pytest.raises(EntryMismatch):
        check(SegmentEntry.from_bytes(built.to_bytes()))
    hit, _, _, leases = _read(servicer, engine, built.key, data, ids, check)
    assert hit.entry is None and hit.data is None and leases == 0
