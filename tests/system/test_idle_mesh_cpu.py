"""An idle mesh costs (almost) no CPU: with NIXL on (the default) segcache and combine once
spent a whole core each doing nothing (nixl's progress thread in a busy loop), which on a small
machine halved the speed of every model step. Measured from /proc/<pid>/stat (user + system time
of every thread) over a few seconds of idleness, after warm requests whose hits did go over NIXL.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

import hypic
from common.mesh.nixl_util import load_nixl
from hypic.launcher import Mesh
from tests.support.tiny import PIC_CONFIGS, save_tiny

IDLE_WINDOW_S = 4.0
MAX_IDLE_CORE_FRACTION = 0.10  # a busy loop is ~1.0; grpc/asyncio timers are ~0.00x

pytestmark = [pytest.mark.timeout(400), pytest.mark.processes]


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_core_fractions(pids: dict[str, int], window_s: float) -> dict[str, float]:
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(window_s)
    took = time.monotonic() - t0
    return {n: round((cpu_seconds(p) - before[n]) / took, 4) for n, p in pids.items()}


def test_idle_mesh_with_nixl_burns_no_cpu(tmp_path: Path, fresh_seed: int) -> None:
    if load_nixl()[0] is None:
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    model = save_tiny("qwen3_5_text", tmp_path / "model", seed=3, **PIC_CONFIGS["qwen3_5_text"])
    # every hit over NIXL, whatever its size: the holder's agent has served READs before we measure
    with Mesh(model, tmp_path / "data", n_scatter=1, threads=1, start_timeout_s=240,
              extra_args={"combine": ["--nixl-min-bytes", "0"]}) as mesh:
        g = random.Random(fresh_seed)
        segs = [[g.randrange(1, 500) for _ in range(n)] for n in (40, 25)]
        with hypic.Client(mesh.router_address, timeout=120) as c:
            c.generate(segments=segs, query=[5, 6], max_tokens=2, stream=False)  # cold: builds
            for _ in range(20):  # the NIXL probe runs in the background: wait for it
                warm = c.generate(segments=segs, query=[5, 6], max_tokens=2, stream=False)
                if warm.timings.trace and all(t.via_nixl for t in warm.timings.trace):
                    break
                time.sleep(0.25)
        assert warm.timings.hits == len(segs)
        assert all(t.via_nixl for t in warm.timings.trace), warm.timings.trace
        time.sleep(1.0)  # let the last request's stragglers (logs, metrics) finish
        pids = {n: s.pid for n, s in mesh.services.items()}
        idle = idle_core_fractions(pids, IDLE_WINDOW_S)
        print(f"idle CPU, fraction of a core over {IDLE_WINDOW_S}s: {idle}")
        assert all(v < MAX_IDLE_CORE_FRACTION for v in idle.values()), idle
    assert mesh.exit_codes and all(c == 0 for c in mesh.exit_codes.values()), mesh.exit_codes
