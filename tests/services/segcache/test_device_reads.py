"""segcache's device tier serving a reader (services/segcache/device_reads.py), on CPU.

A CPU device stands in for the GPU of tier 0 (the store's `_device_tier_device`, overridden below):
every line of the tier's bookkeeping runs as on CUDA. What cannot run here is the CUDA IPC export
itself; on a CPU tensor `export_ipc` refuses, which is exactly the run-time failure the policy must
fall back from. The IPC copy between two CUDA processes is scripts/gpu_check.py's row.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.mesh.transfer_path import Capabilities, Place, export_ipc, local_place, open_ipc
from services.segcache.config import SegcacheConfig
from services.segcache.device_reads import DeviceReads
from services.segcache.store import TIER_DEVICE, TIER_HOST, SegmentStore

KiB = 1024
GPU = "GPU-stand-in"  # the identity DeviceReads reports for the stand-in tier 0
IPC = Capabilities(cuda_ipc=True)


class StandInDeviceStore(SegmentStore):
    """Tier 0 on a CPU device: the tier's code paths without CUDA."""

    def _device_tier_device(self, cfg):
        self._torch = torch
        return torch.device("cpu")


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def store(tmp_path: Path):
    s = StandInDeviceStore(SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, device_bytes=8 * KiB,
                                          host_bytes=64 * KiB, disk_bytes=1 << 20))
    yield s
    s.close()


def test_without_cuda_the_device_tier_is_off_and_every_read_goes_the_host_way(tmp_path: Path) -> None:
    store = SegmentStore(SegcacheConfig(data_dir=tmp_path / "lmdb", lmdb_sync=False, device_bytes=8 * KiB,
                                        host_bytes=64 * KiB, disk_bytes=1 << 20))
    try:
        reads = DeviceReads(store, box="box-a")
        assert not store.device.enabled and reads.gpu is None
        data = blob(2 * KiB, 1)
        store.put("k", data)
        served = reads.serve("k", Place("box-a", "GPU-1"), Capabilities(cuda_ipc=True, nixl_vram=True))
        assert served.path == "host" and served.tried == [] and np.array_equal(served.host.buf, data)
        reads.release(served)
        assert store.leases_active == 0
        assert reads.serve("absent", Place("box-a", "GPU-1"), IPC) is None
    finally:
        store.close()


def test_an_entry_in_tier_0_is_offered_by_ipc_and_falls_back_to_host_when_the_export_fails(store) -> None:
    reads = DeviceReads(store, box="box-a", gpu=GPU)
    data = blob(2 * KiB, 2)
    store.put("k", data)
    assert store.tier_of("k") == TIER_DEVICE
    assert reads.holder("k") == Place("box-a", GPU)
    before = store.stats()["tiers"][0]["hits"]
    served = reads.serve("k", Place("box-a", GPU), IPC)
    # the ipc path was chosen and tried: the export refused the CPU tensor, the lease was given back
    assert served.tried == ["ipc: ValueError: CUDA IPC needs a CUDA tensor, got cpu"]
    assert served.path == "host" and served.ipc is None and served.device is None
    assert np.array_equal(np.asarray(served.host.buf), data) and served.info.tier == TIER_DEVICE
    assert store.stats()["tiers"][0]["hits"] == before + 2  # the device lease's read and the host lease's
    reads.release(served)
    assert store.leases_active == 0 and store.stats()["staging_bytes"] == 0
    assert "k" in store.policy_order(TIER_DEVICE)  # back under eviction once nothing holds it


@pytest.mark.parametrize("reader, caps", [
    (Place("box-a", "GPU-other"), IPC),  # another GPU of the box
    (Place("box-b", GPU), IPC),  # another box
    (Place("box-a", None), IPC),  # a reader on CPU
    (Place("box-a", GPU), Capabilities()),  # same GPU, no IPC on one end
])
def test_a_reader_elsewhere_is_served_from_host_without_trying_the_device(store, reader, caps) -> None:
    reads = DeviceReads(store, box="box-a", gpu=GPU)
    data = blob(2 * KiB, 3)
    store.put("k", data)
    served = reads.serve("k", reader, caps)
    assert (served.path, served.tried) == ("host", [])
    assert np.array_equal(np.asarray(served.host.buf), data)
    reads.release(served)


def test_an_entry_below_tier_0_is_served_from_host(store) -> None:
    reads = DeviceReads(store, box="box-a", gpu=GPU)
    for i in range(6):  # 2 KiB each: tier 0 (8 KiB) keeps the last four, the first two go to host
        store.put(f"k{i}", blob(2 * KiB, 10 + i))
    assert store.tier_of("k0") == TIER_HOST and reads.holder("k0") == Place("box-a", None)
    served = reads.serve("k0", Place("box-a", GPU), IPC)
    assert (served.path, served.tried) == ("host", [])
    reads.release(served)


def test_a_device_lease_pins_the_entry_in_tier_0_until_released(store) -> None:
    store.put("held", blob(2 * KiB, 20))
    lease = store.acquire_device("held")
    assert lease is not None and lease.tensor.numel() == 2 * KiB
    for i in range(8):  # pressure that would demote every unpinned entry of tier 0
        store.put(f"p{i}", blob(2 * KiB, 30 + i))
    assert store.tier_of("held") == TIER_DEVICE and "held" not in store.policy_order(TIER_DEVICE)
    assert store.acquire_device("p0") is None  # demoted to host by then: no device lease
    store.delete(["held"])  # gone from the index at once; the leased tensor stays readable
    assert store.tier_of("held") != TIER_DEVICE and lease.tensor.numel() == 2 * KiB
    store.release_device(lease)
    assert store.leases_active == 0 and store.acquire_device("held") is None


def test_ipc_refuses_cleanly_off_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA tensor"):
        export_ipc(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA tensor"):
        export_ipc(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA reader"):
        open_ipc(None, "cpu")
    here = local_place("cpu")
    assert here.gpu is None and here.box  # a CPU process: the host way whatever the holder
