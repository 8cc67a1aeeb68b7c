"""NIXL, imported defensively, behind a small thread-safe agent wrapper.

    agent = NixlAgent.create("segcache-1234")   # None-safe: check agent.available / agent.reason
    reg = agent.register(array)                  # host numpy buffer (DRAM) or a contiguous tensor
    agent.read_into(local_array, [(addr, length, dev)], "peer", mem_type="DRAM")

Everything raises NixlUnavailable when the nixl package (or its UCX backend) is missing, so a
service can run without it and report why. The nixl agent is not thread-safe in its default
mode; every call here holds one lock per agent.

Progress, and why idle costs nothing: a holder (whose memory peers READ) needs its UCX worker
progressed while it does nothing itself, so it keeps nixl's progress thread; nixl's Python API
creates that thread with a poll timeout of 0, a busy loop burning a whole core. We give it
PROGRESS_POLL_US instead: the thread sleeps in poll() on the workers' event fds and wakes when
UCX signals work. A reader (progress_thread=False) progresses its own worker while it waits for
its READ (check_xfer_state), so it needs no thread at all. close() destroys the agent, joining
nixl's threads before interpreter teardown (a progress thread alive while the process exits
touches freed UCX state: SIGSEGV on SIGTERM).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

from common.mesh.log import adopt_library_loggers

_NIXL: Any = None
_NIXL_ERROR: str | None = None
_IMPORT_LOCK = threading.Lock()


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used in this process (not installed, no backend, disabled)."""


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed or timed out."""


def _has_rdma_device() -> bool:
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


# The backends nixl's meta package falls back to, in its order, when it finds no CUDA version.
NIXL_BACKENDS_WITHOUT_CUDA = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _torch_build_cuda() -> tuple[bool, str | None]:
    """(torch installed, the CUDA version it was built for or None), read from torch/version.py
    without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False, None
    if spec is None or not spec.origin:
        return False, None
    version: dict[str, Any] = {}
    try:
        path = os.path.join(os.path.dirname(spec.origin), "version.py")
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), version)
    except Exception:  # an unreadable version.py: let nixl decide the usual way
        return False, None
    return True, version.get("cuda")


def nixl_backend_without_torch() -> str | None:
    """The backend module that `import nixl` would choose, where nixl's own choice would import
    torch just to learn it is a CPU build; None where the meta package chooses without torch
    (torch imported already, a CUDA build it reads off disk, no torch at all).

    Why: nixl's meta package reads torch's CUDA version off disk, and when that says None (a
    CPU build) imports all of torch to ask again -- 2.5 CPU seconds of segcache's start, in a
    process that never uses torch. It then takes the first installed of
    NIXL_BACKENDS_WITHOUT_CUDA, which is what this returns."""
    if "torch" in sys.modules:
        return None
    installed, cuda = _torch_build_cuda()
    if not installed or cuda is not None:
        return None
    for name in NIXL_BACKENDS_WITHOUT_CUDA:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def _import_nixl_api() -> Any:
    """nixl._api: the backend's own module (the very object nixl aliases as nixl._api)."""
    backend = nixl_backend_without_torch()
    if backend is None:
        from nixl import _api  # type: ignore[import-not-found]
        return _api
    return importlib.import_module(f"{backend}._api")


def load_nixl() -> tuple[Any, str | None]:
    """(nixl._api module or None, reason it is unavailable or None). Imported once."""
    global _NIXL, _NIXL_ERROR
    with _IMPORT_LOCK:
        if _NIXL is None and _NIXL_ERROR is None:
            # nixl's INFO lines (its Python logger's and its C++ core's) are noise at startup.
            os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
            if not _has_rdma_device():
                # With the system's libibverbs1 installed (Mooncake needs it) UCX loads its IB
                # modules beside the wheel's own libibverbs, and the process segfaults at exit;
                # without an RDMA device they are of no use anyway.
                os.environ.setdefault("UCX_MODULES", "^ib")
            try:
                _NIXL = _import_nixl_api()
                adopt_library_loggers()  # nixl's handler prints plain text on stdout
            except Exception as e:  # ImportError, OSError from missing shared libraries, ...
                _NIXL_ERROR = f"nixl import failed: {type(e).__name__}: {e}"
        return _NIXL, _NIXL_ERROR


def _addr_len(buf: Any) -> tuple[int, int, int, str]:
    """(address, length, device id, mem type) of a contiguous numpy array or torch tensor."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        return int(buf.ctypes.data), int(buf.nbytes), 0, "DRAM"
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # torch.Tensor
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous")
        dev = buf.get_device()
        return (int(buf.data_ptr()), int(buf.numel() * buf.element_size()),
                0 if dev < 0 else int(dev), "DRAM" if dev < 0 else "VRAM")
    raise TypeError(f"cannot register {type(buf).__name__}")


# nixl's progress thread waits this long in poll() between wake-ups when nothing happens (it
# wakes at once on UCX events); 0, nixl's Python default, spins.
PROGRESS_POLL_US = 100_000
_CREATE_LOCK = threading.Lock()


def _create_agent(api: Any, name: str, conf: Any, poll_us: int) -> Any:
    """api.nixl_agent(name, conf) with the progress thread's poll timeout set to poll_us.

    nixl_agent.__init__ hard-codes `pthrDelay = 0` on the config it passes to the native agent;
    the native constructor is swapped for the duration of this call (under a lock) for one that
    sets ours first."""
    native = api.nixlBind.nixlAgent

    def with_poll_timeout(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = int(poll_us)
        return native(agent_name, agent_config)

    with _CREATE_LOCK:
        api.nixlBind.nixlAgent = with_poll_timeout
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgent = native


class NixlAgent:
    """One nixl_agent (UCX backend by default). `available` False means every call raises.

    progress_thread: True for a holder whose memory peers read; False for a pure reader."""

    def __init__(self, name: str, backend: str = "UCX", *, enabled: bool = True,
                 progress_thread: bool = True, progress_poll_us: int = PROGRESS_POLL_US):
        self.name = name
        self.backend = backend
        self.available = False
        self.reason: str | None = None
        self._agent: Any = None
        self._lock = threading.Lock()
        self._remotes: dict[str, str] = {}
        if not enabled:
            self.reason = "disabled by configuration"
            return
        api, err = load_nixl()
        if api is None:
            self.reason = err
            return
        try:
            conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend])
            agent = _create_agent(api, name, conf, progress_poll_us)
            if backend not in agent.backends:
                self.reason = f"nixl backend {backend} could not be created (plugins: {agent.plugin_list})"
                return
            self._agent = agent
            self.available = True
        except Exception as e:
            self.reason = f"nixl agent creation failed: {type(e).__name__}: {e}"

    def close(self) -> None:
        """Destroy the native agent now (its threads joined), not at interpreter teardown.
        Idempotent; every later call raises NixlUnavailable."""
        with self._lock:
            agent, self._agent = self._agent, None
            self.available = False
            self.reason = "closed"
            remotes, self._remotes = list(self._remotes), {}
        if agent is None:
            return
        for name in remotes:
            try:
                agent.remove_remote_agent(name)
            except Exception:
                pass
        del agent  # the last reference: the native destructor joins nixl's threads

    def _require(self) -> Any:
        if not self.available:
            raise NixlUnavailable(self.reason or "nixl unavailable")
        return self._agent

    # ---- metadata --------------------------------------------------------------------------
    def metadata(self) -> bytes:
        agent = self._require()
        with self._lock:
            return bytes(agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        agent = self._require()
        with self._lock:
            name = agent.add_remote_agent(metadata)
            if isinstance(name, bytes):
                name = name.decode()
            self._remotes[name] = name
            return name

    def knows(self, remote_name: str) -> bool:
        with self._lock:
            return remote_name in self._remotes

    def forget(self, remote_name: str) -> None:
        agent = self._require()
        with self._lock:
            if self._remotes.pop(remote_name, None) is not None:
                try:
                    agent.remove_remote_agent(remote_name)
                except Exception:
                    pass

    # ---- memory ----------------------------------------------------------------------------
    def register(self, buf: Any) -> Any:
        """Register a contiguous host array (or tensor); returns a handle for deregister()."""
        agent = self._require()
        addr, length, dev, mem = _addr_len(buf)
        with self._lock:
            return agent.register_memory([(addr, length, dev, "")], mem)

    def region_metadata(self, handle: Any) -> bytes:
        """Partial agent metadata for registered region(s) `handle` (what a remote reader must
        load, with add_remote(), to access memory registered after it took our metadata)."""
        agent = self._require()
        with self._lock:
            return bytes(agent.get_partial_agent_metadata(handle, False))

    def deregister(self, handle: Any) -> None:
        agent = self._require()
        with self._lock:
            agent.deregister_memory(handle)

    @staticmethod
    def descriptors(buf: Any) -> tuple[str, list[tuple[int, int, int]]]:
        """(mem type, [(addr, length, device id)]) of a buffer, for a remote reader."""
        addr, length, dev, mem = _addr_len(buf)
        return mem, [(addr, length, dev)]

    # ---- transfers -------------------------------------------------------------------------
    def read_into(self, local: Any, remote: Sequence[tuple[int, int, int]], peer: str, *,
                  mem_type: str = "DRAM", notif: bytes = b"", timeout_s: float = 30.0,
                  registered: bool = False) -> None:
        """Blocking READ of `remote` regions of agent `peer` into the contiguous `local` buffer.

        The remote regions are read back to back into `local`, whose length must equal their
        total. `local` is registered for the transfer unless `registered` says it already is.
        """
        agent = self._require()
        addr, length, dev, local_mem = _addr_len(local)
        total = sum(int(r[1]) for r in remote)
        if total != length:
            raise ValueError(f"local buffer is {length} bytes, remote regions total {total}")
        local_regions, off = [], 0
        for r in remote:
            local_regions.append((addr + off, int(r[1]), dev))
            off += int(r[1])
        reg = None
        handle = None
        try:
            with self._lock:
                if not registered:
                    reg = agent.register_memory([(addr, length, dev, "")], local_mem)
                local_descs = agent.get_xfer_descs(local_regions, local_mem)
                remote_descs = agent.get_xfer_descs([tuple(int(x) for x in r) for r in remote], mem_type)
                handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, notif)
                state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            spins = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlTransferError(f"nixl READ from {peer} timed out after {timeout_s}s")
                spins += 1
                if spins > 200:  # spin briefly, then back off gently
                    time.sleep(min(1e-3, 1e-5 * (spins - 200)))
                with self._lock:
                    state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlTransferError(f"nixl READ from {peer} failed: state {state}")
        finally:
            with self._lock:
                if handle is not None:
                    try:
                        agent.release_xfer_handle(handle)
                    except Exception:
                        pass
                if reg is not None:
                    agent.deregister_memory(reg)

