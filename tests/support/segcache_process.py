"""A segcache server process (`python -m services.segcache` on an ephemeral port, its LMDB in a tmp
dir) and the small helpers the segcache tests share: the `launch` fixture starts as many as a test
needs and checks that each exits cleanly on SIGTERM."""

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
import pytest

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60


class SegcacheProcess:
    """`python -m services.segcache` on an ephemeral port; always killed by the fixture."""

    def __init__(self, tmp_path: Path, args: list[str], name: str = "segcache"):
        self.data_dir = tmp_path / "data"
        self.port_file = tmp_path / f"{name}.port.json"
        self.log_path = tmp_path / f"{name}.log"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.metrics_port = None
        self.info: dict = {}

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "SegcacheProcess":
        self.port_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_SEGCACHE_")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "services.segcache", "--port", "0", "--port-file",
               str(self.port_file), "--data-dir", str(self.data_dir), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"segcache exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"segcache did not start:\n{self.log()}")
            time.sleep(0.05)
        self.info = json.loads(self.port_file.read_text())
        self.port, self.metrics_port = self.info["port"], self.info["metrics_port"]
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 15) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise


@pytest.fixture
def launch(tmp_path: Path):
    procs: list[SegcacheProcess] = []

    def _launch(*args: str, name: str = "segcache") -> SegcacheProcess:
        p = SegcacheProcess(tmp_path, list(args), name)
        procs.append(p)
        return p.start()

    yield _launch
    codes = {p.log_path.name: p.terminate() for p in procs if p.alive()}  # clean SIGTERM exits
    for p in procs:
        p.kill()
    assert all(c == 0 for c in codes.values()), codes


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def code_of(coro) -> grpc.StatusCode:
    async def run():
        try:
            await coro
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK
    return run()
