"""`python -m services.front` alone, as a process on an ephemeral port, its router a closed port
(generation answers 503): for tests of what the front does with the traffic itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.peers import closed_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


class FrontProcess:
    def __init__(self, tmp_path: Path, args: list[str] = ()):
        self.port_file = tmp_path / "front.port.json"
        self.log_path = tmp_path / "front.log"
        self.args = list(args)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FrontProcess":
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYPIC_FRONT_")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "services.front", "--port", "0", "--port-file", str(self.port_file),
               "--router-addresses", f"127.0.0.1:{closed_port()}", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"front did not start:\n{self.log()}")
            time.sleep(0.05)
        self.port = json.loads(self.port_file.read_text())["port"]
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
