"""A scatter worker that serves another model than the router's gets no builds (its entries would
hold another model's states, of no use to this router's requests).
The router learns the worker's model from its Load poll and leaves it out until it serves the
router's model. Two real scatter processes, one per model, polled by the router's ScatterPool."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from common.engine.fingerprint import model_fingerprint
from hypic.launcher import Service
from services.router.planner import Job, Planner
from services.router.pools import ScatterPool
from tests.support.tiny import QWEN_BASE, save_tiny

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """{'ours': (model, scatter), 'theirs': (model, scatter)}: two checkpoints, one worker each."""
    base = tmp_path_factory.mktemp("foreign")
    out, started = {}, []
    try:
        for seed, name in ((1, "ours"), (2, "theirs")):
            model = save_tiny("qwen3_5_text", base / name, seed=seed, **QWEN_BASE)
            svc = Service(name=f"scatter-{name}", kind="scatter",
                          args=["--model", str(model), "--threads", "1"],
                          run_dir=base / "run", log_dir=base / "log")
            svc.start()
            started.append(svc)
            out[name] = (model, svc)
        deadline = time.monotonic() + 240
        for svc in started:
            svc.wait_ready(deadline)
        yield out
    finally:
        for svc in reversed(started):
            svc.stop(grace_s=5)


def test_router_places_no_build_on_a_worker_of_another_model(workers) -> None:
    ours_model, ours = workers["ours"]
    theirs_model, theirs = workers["theirs"]
    fingerprint = model_fingerprint(ours_model)
    assert model_fingerprint(theirs_model) != fingerprint

    async def run() -> None:
        planner = Planner(0)
        pool = ScatterPool([ours.address, theirs.address], [], planner, fingerprint, 10.0)
        try:
            await pool.poll_once()
            assert pool.addresses == [ours.address, theirs.address]
            assert planner.up_workers() == [0]
            ticket = planner.assign([Job(i, f"seg-{i}", 50 + 10 * i) for i in range(8)])
            assert {a.worker for a in ticket.assignments} == {0}
        finally:
            await pool.close()

    asyncio.run(run())
