"""SIGTERM on a real service process: health NOT_SERVING at once, calls still served for the drain
period, then stop -- exit status 0, never death by a signal (a native thread alive at interpreter
teardown once made segcache and combine die with SIGSEGV here), with NIXL used before the signal.

The NIXL agent's own life cycle is checked in-process: close() joins the threads nixl started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.mesh.nixl_util import NixlAgent, load_nixl
from common.mesh.segcache_client import SegcacheClient

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING

pytestmark = pytest.mark.timeout(180)


def nixl_ok() -> bool:
    return load_nixl()[0] is not None


class Segcache:
    """`python -m services.segcache` on an ephemeral port; killed by the fixture if still alive."""

    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None):
        self.port_file = tmp / "segcache.port.json"
        self.log_path = tmp / "segcache.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_SEGCACHE_")}
        full_env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, "-m", "services.segcache", "--port", "0", "--port-file",
               str(self.port_file), "--data-dir", str(tmp / "data"), *args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            assert self.proc.poll() is None, f"segcache exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"segcache did not start:\n{self.log()}"
            time.sleep(0.05)
        self.target = f"127.0.0.1:{json.loads(self.port_file.read_text())['port']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int:
        with grpc.insecure_channel(self.target) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                       timeout=5).status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def launch(tmp_path: Path):
    started: list[Segcache] = []

    def _launch(*args: str, env: dict[str, str] | None = None) -> Segcache:
        started.append(Segcache(tmp_path, list(args), env))
        return started[-1]

    yield _launch
    for s in started:
        s.kill()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def use_nixl(target: str, seed: int) -> None:
    """Put an entry and read it back over NIXL, so the holder's agent has served a READ."""
    blob = np.random.default_rng(seed).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    async with SegcacheClient(target, max_message_bytes=8 << 20) as sc:
        key = f"k{seed}"  # restarts reuse the data directory
        await sc.put(key, blob, recompute_cost_s=0.1)
        ok, why = await sc.nixl_available()
        assert ok, why
        got = await sc.get_via_nixl(key)
        assert got is not None and got.tobytes() == blob


async def lookup_ok(target: str) -> bool:
    async with SegcacheClient(target) as sc:
        return len(await sc.lookup(["k"], timeout=5)) == 1


@pytest.mark.processes
def test_sigterm_drains_then_exits_zero(launch, fresh_seed) -> None:
    if not nixl_ok():
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    drain_s = 2.0
    srv = launch(env={"HYPIC_SEGCACHE_DRAIN_S": str(drain_s)})  # the env variable, not the flag
    asyncio.run(use_nixl(srv.target, fresh_seed))
    assert srv.health() == SERVING
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: srv.health() == NOT_SERVING, 5, "health NOT_SERVING after SIGTERM")
    # still serving new calls during the drain
    assert asyncio.run(lookup_ok(srv.target))
    assert srv.proc.poll() is None, "stopped before the drain period ended"
    code = srv.proc.wait(timeout=drain_s + 30)
    took = time.monotonic() - sent
    assert code == 0, f"exit status {code}:\n{srv.log()}"
    assert took >= drain_s * 0.9, f"exited after {took:.2f}s, drain is {drain_s}s"
    assert '"event": "draining"' in srv.log() and '"event": "stopped"' in srv.log()


@pytest.mark.processes
def test_second_signal_cuts_the_drain_short(launch) -> None:
    srv = launch("--drain-s", "600", "--no-nixl")
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: srv.health() == NOT_SERVING, 5, "health NOT_SERVING after SIGTERM")
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(timeout=30) == 0, srv.log()
    assert '"cut_short_by_signal": 2' in srv.log()


@pytest.mark.processes
def test_no_drain_by_default_and_repeated_nixl_sigterms_exit_zero(launch, fresh_seed) -> None:
    """Without --drain-s the stop is immediate; after NIXL reads, every SIGTERM exits 0 (the
    crash was intermittent: several rounds)."""
    if not nixl_ok():
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    for round_ in range(3):
        srv = launch()
        asyncio.run(use_nixl(srv.target, fresh_seed + round_))
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0, srv.log()
        assert time.monotonic() - sent < 10
        srv.port_file.unlink()


@pytest.mark.processes
def test_bad_drain_values_are_configuration_errors(tmp_path: Path) -> None:
    for bad in ("-1", "inf", "nan"):
        r = subprocess.run([sys.executable, "-m", "services.segcache", "--drain-s", bad,
                            "--data-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
        assert r.returncode == 2 and "drain_s" in r.stderr, (bad, r.stderr)


# ---- the NIXL agent's threads -------------------------------------------------------------------
def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_nixl_agent_close_joins_its_threads_and_readers_start_none() -> None:
    if not nixl_ok():
        pytest.skip(f"nixl unavailable: {load_nixl()[1]}")
    base = threads()
    holder = NixlAgent(f"holder-{os.getpid()}")
    assert holder.available, holder.reason
    with_holder = threads()
    assert with_holder > base  # nixl's progress thread (and UCX's)
    reader = NixlAgent(f"reader-{os.getpid()}", progress_thread=False)
    assert reader.available, reader.reason
    assert threads() == with_holder  # a reader progresses its own worker: no thread
    reader.close()
    holder.close()
    assert threads() == base
    assert not holder.available and holder.reason == "closed"
    holder.close()  # idempotent
