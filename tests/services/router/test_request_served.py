"""RequestState.timings() says how the request was served (Timings.recomputed, seam, served_mode,
shadowed) in every mode, before and after combine's report, and as the drift guard and the shadow
monitor set it; the SDK's Served reads the same figures back."""

from __future__ import annotations

import time

import pytest

from common.engine import modes
from hypic.messages import Served, Timings
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from services.router.request import RequestState

SEGMENTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def state(mode: str, seam: int = 0) -> RequestState:
    req = RequestState(rid="r", mode=modes.to_wire(mode), t0=time.perf_counter(),
                       deadline=time.monotonic() + 10)
    req.segments = [list(s) for s in SEGMENTS]
    req.seam = seam
    return req


def served(req: RequestState, final: bool = True) -> Served:
    return Timings.from_proto(req.timings(final=final)).served


def test_full_recomputes_every_segment() -> None:
    t = state("full").timings(final=False)
    assert (t.recomputed, t.seam, t.served_mode, t.shadowed) == (4, 0, router_pb.PREFILL_MODE_FULL, False)


def test_prefix_recomputes_what_combine_reports_and_all_until_it_does() -> None:
    req = state("prefix")
    assert req.timings(final=False).recomputed == len(SEGMENTS)  # nothing reported: nothing known reused
    for reported in (0, 1, 4):
        req.combine_timings = router_pb.Timings(recomputed=reported)
        req.combine_reported = True
        assert req.timings(final=True).recomputed == reported
        assert served(req) == Served(reused=4 - reported, built=0, recomputed=reported, seam=0,
                                     mode="prefix", shadowed=False)


@pytest.mark.parametrize("mode, seam", [("hypic", 8), ("additive", 0)])
def test_entry_modes_recompute_nothing(mode: str, seam: int) -> None:
    req = state(mode, seam)
    req.combine_timings = router_pb.Timings(recomputed=3)  # a count combine never sends here: ignored
    req.combine_reported = True
    for i, src in enumerate((combine_pb.SOURCE_SEGCACHE, combine_pb.SOURCE_SCATTER,
                             combine_pb.SOURCE_SEGCACHE, combine_pb.SOURCE_LOCAL)):
        req.ready[i] = (src, "host" if src == combine_pb.SOURCE_SEGCACHE else "")
    t = req.timings(final=False)
    assert (t.recomputed, t.seam, t.hits, t.misses) == (0, seam, 2, 2)
    assert served(req) == Served(reused=2, built=2, recomputed=0, seam=seam, mode=mode, shadowed=False)


def test_served_mode_and_shadowed_as_the_guard_and_the_monitor_set_them() -> None:
    req = state("hypic", seam=8)
    assert req.served_mode == modes.to_wire("hypic") and req.served_mode_name == "hypic"
    req.shadowed = True
    assert served(req).shadowed and served(req, final=False).seam == 8
    req.served_mode = modes.to_wire("full")  # the guard served it by full recompute
    t = req.timings(final=True)
    assert (t.served_mode, t.recomputed, t.seam, t.shadowed) == (router_pb.PREFILL_MODE_FULL, 4, 0, True)
    assert served(req) == Served(reused=0, built=0, recomputed=4, seam=0, mode="full", shadowed=True)
    assert req.mode_name == "hypic"  # the asked mode stays what the request metrics count
