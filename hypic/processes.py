"""The child processes of a local mesh (hypic.launcher.Mesh starts them): a `Service` is one
`python -m services.<kind>` process, with its port file, log, health probe and stop; a
`MooncakeMaster` is the shared remote tier's master, ready when its RPC port accepts.

Children die with the launcher: PR_SET_PDEATHSIG on Linux, armed by the child itself after exec
from HYPIC_PARENT_PID, for processes started from the main thread; an atexit hook otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from urllib.parse import urlsplit

from hypic.client import Credentials
from hypic.healthcheck import check, http_check

REPO_ROOT = Path(__file__).resolve().parent.parent
MASTER_BINARY = "mooncake_master"  # ships in the mooncake-transfer-engine(-non-cuda) wheel


def check_remote_url(url: str) -> None:
    """ValueError for what segcache's --remote-url would refuse (exit 2), checked here so that a
    bad URL stops `hypic up` before any process starts (the SDK imports no service code)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "mooncake" or not parts.hostname or port is None or not 0 < port < 65536 \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"remote_url must be mooncake://HOST:PORT, not {url!r}")


class MeshError(RuntimeError):
    """A service did not start, or exited while the mesh was starting."""


@dataclass(eq=False)
class Service:
    """One child process of the mesh."""
    name: str                 # "segcache", "scatter0", "combine0", "router"
    kind: str                 # the services.<kind> module
    args: list[str]           # everything but --port / --port-file
    run_dir: Path
    log_dir: Path
    host: str = "127.0.0.1"
    port: int = 0             # 0 until it is up (ephemeral) or as given
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    die_with_parent: bool = True
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    restarts: int = 0
    credentials: Credentials | None = None  # how the launcher's health probes connect (TLS)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def port_file(self) -> Path:
        return self.run_dir / f"{self.name}.port.json"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        return [self.python, "-m", f"services.{self.kind}", "--host", self.host,
                "--port", str(self.port), "--port-file", str(self.port_file), *self.args]

    def start(self) -> None:
        if self.alive():
            raise MeshError(f"{self.name} is already running (pid {self.proc.pid})")
        self.port_file.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("HYPIC_PARENT_PID", None)
        if self._pdeathsig():
            env["HYPIC_PARENT_PID"] = str(os.getpid())  # the service arms PR_SET_PDEATHSIG itself
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: "
                      f"{' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=log, start_new_session=True)

    def _pdeathsig(self) -> bool:
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only from the main thread.
        return (self.die_with_parent and sys.platform == "linux"
                and threading.current_thread() is threading.main_thread())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, deadline: float) -> None:
        """Until the port file is written and grpc.health.v1 answers SERVING."""
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise MeshError(self.failure(f"exited with status {code} while starting"))
            if self.port_file.exists():
                try:
                    self.info = json.loads(self.port_file.read_text())
                    self.port = int(self.info["port"])
                except (ValueError, KeyError):
                    pass  # written atomically, so only a foreign file; retry
                else:
                    if self.answers():
                        return
            if time.monotonic() > deadline:
                raise MeshError(self.failure("not healthy in time"))
            time.sleep(0.05)

    def answers(self, timeout: float = 1.0) -> bool:
        """The health probe: grpc.health.v1 SERVING, or for the HTTP front GET /health 200."""
        if self.kind == "front":
            return http_check(self.address, timeout, credentials=self.credentials)
        return check(self.address, timeout=timeout, credentials=self.credentials)

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s. Returns the exit status."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        code = self.wait(grace_s)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.wait(10)
        return code

    def failure(self, what: str, n: int = 15) -> str:
        """One line saying why (`what`, and the log's last line: usually the exception), then
        the log's last n lines: what `hypic up` prints when a service does not start."""
        tail = self.log_tail(n)
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
        return (f"{self.name} {what}" + (f": {last}" if last else "")
                + f"\n  last lines of {self.log_path}:\n" + "\n".join(
                    "    " + ln for ln in tail.splitlines()))

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (for a program that cannot report an ephemeral one)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on host:port now. SO_REUSEADDR, as servers bind, so a port
    left in TIME_WAIT by a stopped service does not count as taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow),
    else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def default_threads(model_processes: int, cores: int | None = None) -> int:
    """Torch threads per model process when none are asked for: the cores shared out among the
    scatter and combine processes, at least 1. Torch's own default is one thread per core in every
    process, so that on 2 cores three model processes ran six threads, and a build split over two
    threads waited for both: 14-16x slower than at 1 thread (docs/tuning.md, "Threads per
    process"), the start's warm-up included."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, model_processes))


def reserve_port(host: str) -> socket.socket:
    """A socket bound (not listening) to a free port of `host`, with SO_REUSEADDR: while it is
    held the port is nobody else's (the kernel hands it out to no bind to port 0), yet a server
    binding it with SO_REUSEADDR (gRPC's and the front's do) may listen on it. So a service's
    address can be given to others before it starts; close the socket once it serves."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def find_master_binary(python: str = sys.executable) -> str | None:
    """mooncake_master next to the interpreter (a venv's bin/), else on PATH."""
    return shutil.which(MASTER_BINARY, path=str(Path(python).parent)) or shutil.which(MASTER_BINARY)


def mooncake_missing(python: str = sys.executable) -> str | None:
    """Why a Mooncake Store tier cannot run here (None: it can): the wheel's master binary, or
    the client library, which needs Debian's libibverbs1 (`make` installs it)."""
    if find_master_binary(python) is None:
        return "mooncake_master not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mooncake cannot load ({e}); `make` installs libibverbs1"
    return None


_EXEC_DYING_WITH_PARENT = (
    "import os, sys; from common.mesh.server import die_with_parent_from_env; "
    "die_with_parent_from_env(); os.execv(sys.argv[1], sys.argv[1:])")


@dataclass(eq=False)
class MooncakeMaster(Service):
    """The Mooncake Store master: not one of our services (no port file, no grpc.health), so it
    is started on a port chosen here and is ready when that port accepts connections. Its
    metrics server gets its own free port on the same host (its default, 0.0.0.0:9003, would
    collide between two masters and listen beyond loopback)."""
    binary: str = ""
    metrics_port: int = 0

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}"

    def command(self) -> list[str]:
        # Through a Python trampoline that arms PR_SET_PDEATHSIG (kept across exec) as our own
        # services do, so that the master too dies with the launcher; same pid after exec.
        return [self.python, "-c", _EXEC_DYING_WITH_PARENT, self.binary,
                f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}", *self.args]

    def start(self) -> None:
        if not self.port:
            self.port = free_port(self.host)  # kept across restarts: segcaches know this URL
        if not self.metrics_port:
            self.metrics_port = free_port(self.host)
        super().start()

    def wait_ready(self, deadline: float) -> None:
        while not self.answers():
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise MeshError(self.failure(f"exited with status {code} while starting"))
            if time.monotonic() > deadline:
                raise MeshError(self.failure("not listening in time"))
            time.sleep(0.05)
        self.info = {"port": self.port, "metrics_port": self.metrics_port, "pid": self.pid}

    def answers(self, timeout: float = 1.0) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout):
                return True
        except OSError:
            return False
