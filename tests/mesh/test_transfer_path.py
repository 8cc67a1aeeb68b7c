"""The transfer-path policy (common.mesh.transfer_path): which way an entry goes from segcache to
a reader, and the fallback to the host path, on CPU."""
import itertools

import pytest

from common.mesh.transfer_path import Capabilities, NoPath, Place, read_first, transfer_paths

ALL = Capabilities(cuda_ipc=True, nixl_vram=True)


def test_same_gpu_takes_the_device_paths_first():
    here = Place("box-a", "GPU-1")
    assert transfer_paths(here, Place("box-a", "GPU-1"), ALL) == ["ipc", "vram", "host"]
    assert transfer_paths(here, here, Capabilities(nixl_vram=True)) == ["vram", "host"]
    assert transfer_paths(here, here, Capabilities(cuda_ipc=True)) == ["ipc", "host"]
    assert transfer_paths(here, here, Capabilities()) == ["host"]


@pytest.mark.parametrize("holder, reader", [
    (Place("box-a", "GPU-1"), Place("box-a", "GPU-2")),  # other GPU, same box
    (Place("box-a", "GPU-1"), Place("box-b", "GPU-1")),  # other box (same UUID string: still another GPU)
    (Place("box-a", None), Place("box-a", "GPU-1")),  # entry in host memory
    (Place("box-a", "GPU-1"), Place("box-a", None)),  # reader on CPU
    (Place("box-a", None), Place("box-a", None)),  # a CPU mesh
])
def test_everything_else_goes_the_host_way(holder, reader):
    assert transfer_paths(holder, reader, ALL) == ["host"]


def test_every_choice_ends_with_host_and_keeps_the_order():
    places = [Place(b, g) for b, g in itertools.product(("a", "b"), (None, "G1", "G2"))]
    for h, r, ipc, vram in itertools.product(places, places, (False, True), (False, True)):
        paths = transfer_paths(h, r, Capabilities(ipc, vram))
        assert paths[-1] == "host" and paths == sorted(paths, key=["ipc", "vram", "host"].index)
        assert len(paths) == 1 or (h.box == r.box and h.gpu == r.gpu and h.gpu is not None)


def test_a_failing_fast_path_falls_back_to_host():
    def ipc():
        raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")

    used, data, tried = read_first(["ipc", "vram", "host"], {"ipc": ipc, "host": lambda: b"entry"})
    assert (used, data) == ("host", b"entry")
    assert tried[0].startswith("ipc: RuntimeError: cudaIpcOpenMemHandle") and tried[1] == "vram: no reader"


def test_the_first_working_path_is_used_and_nothing_after_it_runs():
    calls = []
    readers = {p: (lambda p=p: calls.append(p) or p) for p in ("ipc", "vram", "host")}
    assert read_first(["vram", "host"], readers)[:2] == ("vram", "vram") and calls == ["vram"]


def test_no_working_path_is_an_error_naming_each_reason():
    def broken():
        raise OSError("segcache gone")

    with pytest.raises(NoPath, match="host: OSError: segcache gone"):
        read_first(["host"], {"host": broken})
    with pytest.raises(ValueError, match="unknown transfer path"):
        read_first(["p2p"], {})
