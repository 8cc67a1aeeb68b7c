"""Start the whole Hypic mesh locally, as processes on 127.0.0.1 (what `hypic up` runs; tests and
benchmarks use the same class).

    from hypic.launcher import Mesh

    with Mesh("models/hypic-tiny-qwen35", data_dir=tmp, n_scatter=2) as mesh:
        client = hypic.Client(mesh.router_address)
        ...
        mesh.kill("scatter0")              # SIGKILL, like a crash
        mesh.restart("scatter0")           # same port, waits until healthy again
        mesh.addresses                     # {"segcache": ..., "scatter0": ..., "combine0": ..., "router": ...}

    Mesh(..., n_segcache=4, remote_tier=True)   # 4 segcache instances + a Mooncake master
    Mesh(..., remote_url=other.remote_url)      # another "box" sharing that master

Services and their order: mooncake (with remote_tier: the Mooncake Store master, ready when its
RPC port accepts) → segcache, segcache1..n-1 (LMDB under data_dir/segcache, data_dir/segcache1,
...; each given --remote-url when there is a shared tier) → scatter0..m-1 and combine0..k-1 (they
get every segcache address and place keys by rendezvous hashing) → router (it needs everybody's)
→ front (with front=True: the OpenAI-compatible HTTP API; ready when GET /health answers 200,
which it does once the router answers). That is the order each is waited for and reported ready;
processes start earlier where they can (`Mesh._start_services`): the scatters, the combines and
the front with the segcaches, on ports held for the segcaches and the router (`reserve_port`). Model processes get `default_threads` torch threads unless `threads` says.
Each is `python -m services.<kind> --port P --port-file F ...`; ready means it wrote its port
file and answers grpc.health.v1 SERVING. Ports are ephemeral unless given; a restarted service
keeps its port so the others' addresses stay valid. Logs go to data_dir/logs/<name>.log.
Children die with the launcher (PR_SET_PDEATHSIG on Linux, armed by the child itself after exec
from HYPIC_PARENT_PID, for processes started from the main
thread; an atexit hook otherwise) and are stopped in reverse order (SIGTERM, then SIGKILL after
`grace_s`).
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from hypic.client import Credentials
from hypic.processes import (MASTER_BINARY, REPO_ROOT, MeshError, MooncakeMaster, Service,  # noqa: F401
                             check_remote_url, default_threads, find_master_binary, free_port,
                             mooncake_missing, port_taken, reserve_port, usable_cores)

DEFAULT_MODEL = REPO_ROOT / "models" / "hypic-tiny-qwen35"
DEFAULT_DATA_DIR = Path(".hypic-data")
KINDS = ("segcache", "scatter", "combine", "router", "front")


class Mesh:
    """The local mesh; a context manager (start on enter, stop on exit)."""

    def __init__(self, model: str | os.PathLike[str] | None = None,
                 data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR, n_scatter: int = 2, *,
                 n_combine: int = 1, host: str = "127.0.0.1", router_port: int = 0,
                 segcache_port: int = 0, scatter_ports: Sequence[int] | None = None,
                 combine_ports: Sequence[int] | None = None, segcache: bool = True,
                 external_combine: Sequence[str] = (), seam: int = 8, dtype: str = "float32",
                 device: str = "cpu", gpus: Sequence[str] | None = None,
                 threads: int | None = None, env: Mapping[str, str] | None = None,
                 extra_args: Mapping[str, Sequence[str]] | None = None,
                 log_dir: str | os.PathLike[str] | None = None, start_timeout_s: float = 180.0,
                 grace_s: float = 10.0, python: str = sys.executable,
                 die_with_parent: bool = True, front: bool = False, front_port: int = 0,
                 tls: bool = False, n_segcache: int = 1,
                 segcache_ports: Sequence[int] | None = None, remote_tier: bool = False,
                 remote_url: str = "", master_port: int = 0,
                 entry_key_file: str | os.PathLike[str] | None = None,
                 on_ready: Callable[[str, Service, float], None] | None = None):
        """model: checkpoint directory (default: the bundled models/hypic-tiny-qwen35).
        n_scatter / n_combine: worker counts (n_scatter 0: misses are built on combine).
        segcache=False: no cache service. n_segcache: segcache instances (the first is named
        "segcache", the others "segcache1".."segcacheN-1"; segcache_port / segcache_ports fix
        their ports); every client gets all of their addresses. remote_tier: also start a
        Mooncake Store master ("mooncake", on master_port or a free one) and give every segcache
        --remote-url to it; remote_url: an external master's mooncake://HOST:PORT instead (e.g.
        another Mesh's `remote_url`, standing for another box sharing the tier).
        external_combine: combine addresses the router uses instead of (or besides) the ones
        started here (n_combine may then be 0).
        gpus: CUDA device ids, one per scatter worker and then one per combine (round-robin).
        threads: torch threads per model process (scatter/combine --threads); None: the usable
        cores shared out among the model processes started here (`default_threads`); 0: torch's
        own default (one per core in each).
        front: also start the OpenAI-compatible HTTP front (services.front) on front_port.
        extra_args: more flags per kind or name, e.g. {"router": ["--max-in-flight", "4"]}.
        tls: mutual TLS everywhere, with a throwaway CA made in data_dir/tls (hypic/certs.py);
        `client_credentials` is then what an SDK client needs (the "client" certificate); the
        front serves HTTPS (mutual) and is an mTLS client of the router (the "front" certificate).
        env HYPIC_ROUTER_API_KEY (`hypic up --api-key`): the router's key, which the front then
        both shows to the router and asks of its own clients.
        entry_key_file: the entry seal key of every service (default: made once in
        data_dir/entry.key); a mesh never runs without one.
        on_ready(name, service, seconds since start): called as each service becomes ready
        (`hypic up` prints its progress with it)."""
        # Absolute paths: the children may run elsewhere than the caller's working directory.
        self.model = (Path(model) if model is not None else DEFAULT_MODEL).absolute()
        self.data_dir = Path(data_dir).absolute()
        self.n_scatter = int(n_scatter)
        self.n_combine = int(n_combine)
        self.host = host
        self.seam = seam
        self.dtype = dtype
        self.device = device
        self.gpus = list(gpus) if gpus else None
        self.threads = (default_threads(self.n_scatter + self.n_combine) if threads is None
                        else int(threads))
        self.env = dict(env or {})
        self.extra_args = {k: list(v) for k, v in (extra_args or {}).items()}
        self.log_dir = Path(log_dir).absolute() if log_dir is not None else self.data_dir / "logs"
        self.run_dir = self.data_dir / "run"
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.python = python
        self.die_with_parent = die_with_parent
        self._set_tiers(segcache, n_segcache, remote_tier, remote_url)
        self.tls = tls
        self._entry_key_file = Path(entry_key_file).absolute() if entry_key_file else None
        self.certs: Any = None  # hypic.certs.MeshCerts once started with tls
        self.external_combine = list(external_combine)
        self.use_front = front
        self._check_workers()
        seg_ports = list(segcache_ports or [segcache_port] * min(self.n_segcache, 1)
                         + [0] * (self.n_segcache - 1))
        self._ports = self._ports_by_name(seg_ports, scatter_ports, combine_ports, mooncake=master_port,
                                          router=router_port, front=front_port)
        self.services: dict[str, Service] = {}
        # name -> exit status at stop() of each service running then (0: a clean SIGTERM
        # shutdown; < 0: died by a signal)
        self.exit_codes: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._started = False
        self.on_ready = on_ready
        self._t0 = time.monotonic()

    def _check_workers(self) -> None:
        if self.n_scatter < 0 or self.n_combine < 0:
            raise ValueError("n_scatter and n_combine must be >= 0")
        if self.n_combine == 0 and not self.external_combine:
            raise ValueError("the router needs a combine: n_combine >= 1 or external_combine")

    def _set_tiers(self, segcache: bool, n_segcache: int, remote_tier: bool, remote_url: str) -> None:
        """The cache tiers: segcache instances, and a shared remote tier started (remote_tier) or
        joined (remote_url); ValueError for a combination that cannot run."""
        self.use_segcache = segcache
        self.n_segcache = int(n_segcache) if segcache else 0
        if segcache and self.n_segcache < 1:
            raise ValueError("n_segcache must be >= 1 (segcache=False runs without one)")
        if remote_tier and remote_url:
            raise ValueError("remote_tier starts a master; remote_url names one: not both")
        if (remote_tier or remote_url) and not segcache:
            raise ValueError("the shared remote tier needs segcache")
        self.use_master = bool(remote_tier)
        self.external_remote_url = remote_url.strip()
        if self.external_remote_url:
            check_remote_url(self.external_remote_url)

    def _ports_by_name(self, segcache_ports: list[int], scatter_ports: Sequence[int] | None,
                       combine_ports: Sequence[int] | None, **single: int) -> dict[str, int]:
        """Each service's port as given (0: ephemeral); ValueError unless one per instance."""
        scatter_ports = list(scatter_ports or [0] * self.n_scatter)
        combine_ports = list(combine_ports or [0] * self.n_combine)
        if len(scatter_ports) != self.n_scatter or len(combine_ports) != self.n_combine:
            raise ValueError("one port per scatter / combine worker")
        if len(segcache_ports) != self.n_segcache:
            raise ValueError("one port per segcache instance")
        return {**{self.segcache_name(i): p for i, p in enumerate(segcache_ports)}, **single,
                **{f"scatter{i}": p for i, p in enumerate(scatter_ports)},
                **{f"combine{i}": p for i, p in enumerate(combine_ports)}}

    # ---- names and addresses -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Service names in start order."""
        out = ["mooncake"] if self.use_master else []
        out += [self.segcache_name(i) for i in range(self.n_segcache)]
        out += [f"scatter{i}" for i in range(self.n_scatter)]
        out += [f"combine{i}" for i in range(self.n_combine)]
        return out + ["router"] + (["front"] if self.use_front else [])

    @property
    def addresses(self) -> dict[str, str]:
        return {n: s.address for n, s in self.services.items() if s.port}

    @property
    def router_address(self) -> str:
        return self.services["router"].address

    @property
    def front_url(self) -> str:
        """http://host:port of the OpenAI-compatible front (its API is under /v1); https:// with
        tls (mutual: clients show a certificate of the mesh CA, e.g. `client_credentials`'s)."""
        return f"{'https' if self.tls else 'http'}://{self.services['front'].address}"

    @staticmethod
    def segcache_name(i: int) -> str:
        return "segcache" if i == 0 else f"segcache{i}"

    @property
    def segcache_addresses(self) -> list[str]:
        return [self.services[self.segcache_name(i)].address for i in range(self.n_segcache)]

    @property
    def segcache_address(self) -> str:
        """Every segcache instance, comma-separated (what --segcache-address takes)."""
        return ",".join(self.segcache_addresses)

    @property
    def remote_url(self) -> str:
        """mooncake://HOST:PORT of the shared tier ("" without one): give it to another Mesh."""
        if self.use_master:
            return self.services["mooncake"].url
        return self.external_remote_url

    @property
    def scatter_addresses(self) -> list[str]:
        return [self.services[f"scatter{i}"].address for i in range(self.n_scatter)]

    @property
    def combine_addresses(self) -> list[str]:
        return [self.services[f"combine{i}"].address for i in range(self.n_combine)] + \
            self.external_combine

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    @property
    def entry_key_file(self) -> Path:
        """The mesh's entry secret (common/engine/pic/seal.py), made once per data directory and kept, so
        that entries cached by an earlier run still open; give it to an external combine too.
        The one given to the constructor, if any (it must exist)."""
        if self._entry_key_file is not None:
            if not self._entry_key_file.is_file():
                raise MeshError(f"entry key file {self._entry_key_file} does not exist")
            return self._entry_key_file
        path = self.data_dir / "entry.key"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"entry.key.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            os.replace(tmp, path)
        return path

    # ---- building each service ---------------------------------------------------------------------
    def service_args(self, kind: str, *, segcache: str = "", scatter: Sequence[str] = (),
                     combine: Sequence[str] = (), router: str = "") -> list[str]:
        """The flags (besides --host/--port/--port-file) a service of `kind` is started with."""
        key = ["--entry-key-file", str(self.entry_key_file)]
        if kind == "segcache":
            remote = ["--remote-url", self.remote_url] if self.remote_url else []
            return ["--data-dir", str(self.data_dir / "segcache"), *key, *remote]
        if kind in ("scatter", "combine"):
            args = ["--model", str(self.model), "--dtype", self.dtype, "--device", self.device, *key]
            if self.threads:
                args += ["--threads", str(self.threads)]
            return args + (["--segcache-address", segcache] if segcache else [])
        if kind == "router":
            args = ["--model", str(self.model), "--seam", str(self.seam), "--dtype", self.dtype,
                    "--combine-addresses", ",".join(combine)]
            if segcache:
                args += ["--segcache-address", segcache]
            if scatter:
                args += ["--scatter-addresses", ",".join(scatter)]
            return args
        if kind == "front":
            # with tls: HTTPS for its clients, and the "front" certificate shown to the router
            return ["--model", str(self.model), "--router-addresses", router] + (
                ["--https"] if self.tls else [])
        raise ValueError(f"unknown service kind {kind!r}")

    def _service(self, name: str, kind: str, args: list[str], gpu: str | None = None, *,
                 port: int | None = None) -> Service:
        env = dict(self.env)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        if kind == "front" and env.get("HYPIC_ROUTER_API_KEY"):
            # the router's key (`hypic up --api-key`): the front shows it to the router and asks
            # its own clients for it, so no door of the mesh is open without the key
            env.setdefault("HYPIC_FRONTEND_ROUTER_API_KEY", env["HYPIC_ROUTER_API_KEY"])
            env.setdefault("HYPIC_FRONTEND_API_KEY", env["HYPIC_ROUTER_API_KEY"])
        args = args + self.extra_args.get(kind, []) + (
            self.extra_args.get(name, []) if name != kind else [])
        if self.certs is not None:
            args = self.certs.flags(kind) + args
        return Service(name=name, kind=kind, args=args, run_dir=self.run_dir,
                       log_dir=self.log_dir, host=self.host, port=port or self._ports[name], env=env,
                       python=self.python, die_with_parent=self.die_with_parent,
                       credentials=self.client_credentials)

    @property
    def client_credentials(self) -> Credentials | None:
        """The SDK's credentials for this mesh (None without tls):
        hypic.Client(address, credentials=mesh.client_credentials)."""
        if self.certs is None:
            return None
        return Credentials(tls_ca=self.certs.ca, tls_cert=self.certs.cert("client"),
                           tls_key=self.certs.key("client"))

    def _gpu(self, i: int) -> str | None:
        return self.gpus[i % len(self.gpus)] if self.gpus else None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Mesh":
        if self._started:
            return self
        if not (self.model / "config.json").exists():
            raise MeshError(f"no model at {self.model} (config.json missing); pass another model")
        self._check_ports()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.tls and self.certs is None:
            from hypic.certs import generate_mesh_certs  # cryptography: only when asked for

            self.certs = generate_mesh_certs(self.data_dir / "tls")
        self._started = True
        atexit.register(self.stop)
        self._t0 = time.monotonic()
        held = self._reserve_ports()
        try:
            self._start_services(time.monotonic() + self.start_timeout_s, held)
        except BaseException:
            self.stop()
            raise
        finally:
            for sock in held.values():
                sock.close()
        return self

    def _reserve_ports(self) -> dict[str, socket.socket]:
        """Ephemeral ports held now for the segcaches and the router (name -> socket), so that the
        services that only need their addresses start before them (`_start_services`)."""
        names = [n for n in self.names if n == "router" or n.startswith("segcache")]
        return {n: reserve_port(self.host) for n in names if not self._ports[n]}

    def _start_services(self, deadline: float, held: dict[str, socket.socket]) -> None:
        """Everything, each process as early as it can run, since on a small machine the start is
        the processes' CPU (imports, model load, warm-up): the segcaches, scatters, combines and
        front at once (workers reach segcache per request, and a combine probes its NIXL agent in
        the background until it answers; the front's /health waits for the router); the router
        once every worker serves. Ready is reported in that order."""
        port = {n: sock.getsockname()[1] for n, sock in held.items()}
        if self.use_master:
            self._start_master(deadline)
        segcaches = self._start_segcaches(port)
        seg_addr = self.segcache_address
        scatters = [self._run(self._service(f"scatter{i}", "scatter", self.service_args(
            "scatter", segcache=seg_addr), self._gpu(i))) for i in range(self.n_scatter)]
        router_address = f"{self.host}:{port.get('router') or self._ports['router']}"
        front = self._run(self._service("front", "front", self.service_args(
            "front", router=router_address))) if self.use_front else None
        combines = [self._run(self._service(f"combine{i}", "combine", self.service_args(
            "combine", segcache=seg_addr), self._gpu(self.n_scatter + i)))
            for i in range(self.n_combine)]
        for svc in segcaches + scatters + combines:
            self._wait_ready(svc, deadline)
        router = self._run(self._service("router", "router", self.service_args(
            "router", segcache=seg_addr, scatter=self.scatter_addresses,
            combine=self.combine_addresses), port=port.get("router")))
        self._wait_ready(router, deadline)
        if front is not None:
            self._wait_ready(front, deadline)

    def _run(self, svc: Service) -> Service:
        self.services[svc.name] = svc
        svc.start()
        return svc

    def _check_ports(self) -> None:
        """MeshError naming every fixed port that something already listens on, before any
        process starts (else the services before it would start and the one on it fail late)."""
        taken = [f"{name} port {port}" for name, port in self._ports.items()
                 if port and name in self.names and port_taken(self.host, port)]
        if taken:
            raise MeshError(f"already in use on {self.host}: {', '.join(taken)} "
                            "(stop what holds it, or pick another port; 0 = ephemeral)")

    def _wait_ready(self, svc: Service, deadline: float) -> None:
        svc.wait_ready(deadline)
        if self.on_ready is not None:
            self.on_ready(svc.name, svc, time.monotonic() - self._t0)

    def _start_master(self, deadline: float) -> None:
        binary = find_master_binary(self.python)
        if binary is None:
            raise MeshError(f"{MASTER_BINARY} not found (pip install "
                            "mooncake-transfer-engine-non-cuda, or -cuda on CUDA machines)")
        master = MooncakeMaster(name="mooncake", kind="mooncake", args=list(
            self.extra_args.get("mooncake", [])), run_dir=self.run_dir, log_dir=self.log_dir,
            host=self.host, port=self._ports["mooncake"], env=dict(self.env),
            die_with_parent=self.die_with_parent, binary=binary)
        self.services["mooncake"] = master
        master.start()
        self._wait_ready(master, deadline)

    def _start_segcaches(self, port: dict[str, int]) -> list[Service]:
        """Start the segcache instances (in parallel, on the ports in `port` where given)."""
        started = []
        for i in range(self.n_segcache):
            name = self.segcache_name(i)
            args = self.service_args("segcache")
            if i:
                args[args.index("--data-dir") + 1] = str(self.data_dir / name)
            started.append(self._run(self._service(name, "segcache", args, port=port.get(name))))
        return started

    def stop(self) -> None:
        """Stop everything: the router first, then the workers, segcache, the master last."""
        with self._lock:
            order = [n for n in reversed(self.names) if n in self.services]
            groups = [[n for n in order if n in ("front", "router")],
                      [n for n in order if n.startswith(("scatter", "combine"))],
                      [n for n in order if n.startswith("segcache")],
                      [n for n in order if n == "mooncake"]]
            for group in groups:
                group = [n for n in group if self.services[n].alive()]  # not the ones killed before
                for n in group:
                    self.services[n].signal(signal.SIGTERM)
                deadline = time.monotonic() + self.grace_s
                for n in group:
                    svc = self.services[n]
                    code = svc.wait(max(0.0, deadline - time.monotonic()))
                    if code is None:
                        svc.signal(signal.SIGKILL)
                        code = svc.wait(10)
                    self.exit_codes[n] = code
                    if code is not None:
                        svc.port_file.unlink(missing_ok=True)  # a clean stop leaves no stale file
            self._started = False
            atexit.unregister(self.stop)

    def __enter__(self) -> "Mesh":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- fault injection and recovery -------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (default SIGKILL: a crash) to one service and wait until it is gone."""
        svc = self.services[name]
        svc.signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            svc.wait(self.grace_s + 10)

    def restart(self, name: str, *, wait: bool = True, timeout_s: float | None = None) -> Service:
        """Stop `name` if it runs, start it again on the same port, wait until healthy."""
        svc = self.services[name]
        if svc.alive():
            svc.stop(self.grace_s)
        svc.restarts += 1
        svc.start()
        if wait:
            svc.wait_ready(time.monotonic() + (timeout_s or self.start_timeout_s))
        return svc

    def healthy(self, name: str | None = None) -> bool:
        names = [name] if name else list(self.services)
        return all(self.services[n].alive() and self.services[n].answers()
                   for n in names)

    def wait_healthy(self, names: Iterable[str] | None = None, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for n in (list(names) if names is not None else list(self.services)):
            self.services[n].wait_ready(deadline)

    def dead(self) -> list[str]:
        """Services whose process has exited."""
        return [n for n, s in self.services.items() if s.proc is not None and not s.alive()]

    def log(self, name: str) -> str:
        return self.services[name].log()

    def describe(self) -> dict[str, Any]:
        return {"router": self.router_address if "router" in self.services else None,
                "front": self.front_url if "front" in self.services else None,
                "model": str(self.model), "data_dir": str(self.data_dir),
                "log_dir": str(self.log_dir),
                "tls": None if self.certs is None else {
                    "ca": str(self.certs.ca), "cert": str(self.certs.cert("client")),
                    "key": str(self.certs.key("client"))},
                "services": {n: {"address": s.address, "pid": s.pid}
                             for n, s in self.services.items()}}
