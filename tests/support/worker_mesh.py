"""scatter + combine as real server processes on 127.0.0.1 (ephemeral ports), with a real
segcache, on a tiny random qwen3_5_text checkpoint: the processes, the package-scoped fixtures
(one mesh per test package: segcache, one scatter worker storing into it, one combine worker) and
the helpers the scatter and combine tests share. The reference answers come from
HybridEngine.prefill_segments in the test process."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import segment_key
from common.mesh.segcache_client import SegcacheClient
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from tests.support.tiny import PIC_CONFIGS, save_tiny

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120
RPC_TIMEOUT_S = 60
SEAM = 8
N_TOKENS = 8
# The entry secret scatter and combine share (segcache here is left without it: entries are
# opaque bytes to it, so that combine's own checks are what is tested).
SECRET = os.urandom(32).hex().encode()
TOL = 1e-4

# ---- processes ----------------------------------------------------------------------------------
class Service:
    """A server process on an ephemeral port (`python -m services.<name>`, or a script); always
    killed by the fixture."""

    def __init__(self, name: str, argv: list[str], tmp: Path):
        self.name = name
        self.port_file = tmp / f"{name}.port.json"
        self.log_path = tmp / f"{name}.log"
        self.port_file.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=log, stderr=log)
        self.info: dict = {}

    def wait(self) -> "Service":
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start:\n{self.log()}")
            time.sleep(0.05)
        self.info = json.loads(self.port_file.read_text())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM (graceful shutdown); its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


# The model workers' entries are pinned to fp32 here (workers default to bf16,
# common.engine.dtypes.WORKER_ENTRY_FORMAT): these tests compare what the workers compute with the
# in-process `engine` fixture's exact fp32 entries and logits, bit for bit or at 1e-4, and are about
# the workers' calls, not the storage format (tests/engine/pic/test_entry_formats.py and
# bench.quality.eval --entry-formats measure bf16). A test may pass its own --entry-format.
MODEL_WORKERS = ("services.scatter", "services.combine")
PINNED_ENTRY_FORMAT = "fp32"
# The same pin for a whole mesh (hypic.launcher.Mesh(env=...)) whose answers a test compares with an
# in-process engine's at 1e-4.
FP32_ENTRIES_ENV = {f"HYPIC_{kind}_ENTRY_FORMAT": PINNED_ENTRY_FORMAT for kind in ("SCATTER", "COMBINE")}


class WorkerMesh:
    """segcache, scatter and combine processes of one test package, and a port that refuses."""

    def __init__(self, tmp: Path, model: Path | None):
        self.tmp = tmp
        self.model = model
        self.services: list[Service] = []
        # A port that refuses connections for the whole module: bound, never listening.
        self._dead = socket.socket()
        self._dead.bind(("127.0.0.1", 0))
        self.dead = f"127.0.0.1:{self._dead.getsockname()[1]}"

    def start(self, name: str, module: str, *args: str) -> Service:
        port_file = self.tmp / f"{name}.port.json"
        if module in MODEL_WORKERS and "--entry-format" not in args:
            args = (*args, "--entry-format", PINNED_ENTRY_FORMAT)
        return self.start_argv(name, ["-m", module, "--port", "0", "--port-file", str(port_file), *args])

    def start_argv(self, name: str, argv: list[str]) -> Service:
        s = Service(name, argv, self.tmp)
        self.services.append(s)
        return s

    def close(self) -> None:
        for s in self.services:
            s.kill()
        self._dead.close()

    def stop(self) -> dict[str, int]:
        """SIGTERM every service still running; their exit statuses (0: clean)."""
        return {s.name: s.terminate() for s in self.services if s.alive()}


@pytest.fixture(scope="package")
def workdir():
    # A private directory, not pytest's numbered tmp dirs: other pytest sessions running on the
    # same machine rotate those, and the servers' files must outlive them.
    d = Path(tempfile.mkdtemp(prefix="hypic-scatter-combine-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="package")
def model_dir(workdir) -> Path:
    return save_tiny("qwen3_5_text", workdir / "model", seed=5, **PIC_CONFIGS["qwen3_5_text"])


@pytest.fixture(scope="package")
def mesh(request, workdir):
    tmp = workdir / "mesh"
    tmp.mkdir()
    m = WorkerMesh(tmp, None)
    key_file = tmp / "entry.key"
    key_file.write_bytes(SECRET)
    try:
        m.segcache = m.start("segcache", "services.segcache", "--data-dir", str(tmp / "segcache-data"),
                             "--host-bytes", "64MiB", "--disk-bytes", "256MiB", "--no-lmdb-sync",
                             "--log-level", "debug")
        m.model = model_dir = request.getfixturevalue("model_dir")  # saved while segcache starts
        m.segcache.wait()
        # scatter and combine load the model at the same time
        m.scatter = m.start("scatter", "services.scatter", "--model", str(model_dir), "--threads", "1",
                            "--segcache-address", m.segcache.target, "--entry-key-file", str(key_file))
        # combine: its segcache ring (plans may name only its members): the live instance and a
        # member that refuses (the fallback tests' failing segcache); NIXL for every size of hit
        m.combine = m.start("combine", "services.combine", "--model", str(model_dir), "--threads", "1",
                            "--metrics-port", "0", "--segcache-address", f"{m.segcache.target},{m.dead}",
                            "--nixl-min-bytes", "0", "--entry-key-file", str(key_file))
        m.scatter.wait()
        m.combine.wait()
        yield m
        # graceful shutdown on SIGTERM: health NOT_SERVING, calls drained, exit status 0
        codes = {s.name: s.terminate() for s in (m.combine, m.scatter)}
        assert codes == {"combine": 0, "scatter": 0}, codes
        assert '"event": "stopped"' in m.combine.log() and '"event": "stopped"' in m.scatter.log()
        rest = m.stop()  # segcache and whatever a test started
        assert rest and all(c == 0 for c in rest.values()), rest
    finally:
        m.close()


@pytest.fixture(scope="package")
def engine(model_dir) -> HybridEngine:
    # One thread: on 2 shared cores next to three servers, more threads only spin and wait.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HybridEngine.from_pretrained(model_dir)
    torch.set_num_threads(threads)


# ---- helpers ------------------------------------------------------------------------------------
def arun(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def prompt(seed: int, lengths, qlen: int = 5):
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    return segs, torch.randint(0, 512, (qlen,), generator=g).tolist()


def build_request(engine, ids, seam=SEAM, **kw) -> scatter_pb.BuildRequest:
    return scatter_pb.BuildRequest(key=segment_key(engine.fingerprint, seam, "float32", ids), token_ids=ids,
                            seam=seam, model_fingerprint=engine.fingerprint, dtype="float32", **kw)


async def build(target: str, req: scatter_pb.BuildRequest) -> tuple[scatter_pb.BuildHeader, bytes]:
    async with grpc.aio.insecure_channel(target) as ch:
        header, data = None, bytearray()
        async for msg in scatter_grpc.ScatterStub(ch).Build(req, timeout=RPC_TIMEOUT_S):
            if msg.HasField("header"):
                header = msg.header
            data += msg.data
        return header, bytes(data)


def make_plan(engine, mesh, segs, query, source, *, mode=router_pb.PREFILL_MODE_HYPIC, seam=SEAM,
              workers=None, scatter=None, segcache=None, **kw) -> combine_pb.Plan:
    key_seam = 0 if mode == router_pb.PREFILL_MODE_ADDITIVE else seam
    planned = [combine_pb.PlannedSegment(key=segment_key(engine.fingerprint, key_seam, "float32", s), token_ids=s,
                                  source=source, worker=(workers[i] if workers else 0))
               for i, s in enumerate(segs)]
    args = dict(segments=planned, query=query, seam=seam, model_fingerprint=engine.fingerprint,
                dtype="float32", mode=mode, max_tokens=N_TOKENS, return_logits=True,
                scatter_addresses=[mesh.scatter.target] if scatter is None else scatter,
                segcache_address=mesh.segcache.target if segcache is None else segcache,
                store_entries=True)
    args.update(kw)
    return combine_pb.Plan(**args)


class Answer:
    def __init__(self, events, client_ttft_s: float):
        self.segments = [e.segment for e in events if e.HasField("segment")]
        self.tokens = [e.token for e in events if e.HasField("token")]
        self.timings = [e.timings for e in events if e.HasField("timings")]
        self.kinds = [e.WhichOneof("event") for e in events]  # the event order
        self.client_ttft_s = client_ttft_s

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def logits(self) -> torch.Tensor:
        return torch.tensor(list(self.tokens[0].logits))

    def sources(self) -> list[int]:
        return [s.source for s in sorted(self.segments, key=lambda s: s.index)]


async def execute(target: str, plan: combine_pb.Plan, metadata=None, timeout: float = RPC_TIMEOUT_S) -> Answer:
    async with grpc.aio.insecure_channel(target) as ch:
        t0 = time.perf_counter()
        events, ttft = [], None
        async for ev in combine_grpc.CombineStub(ch).Execute(plan, timeout=timeout, metadata=metadata):
            if ev.HasField("token") and ttft is None:
                ttft = time.perf_counter() - t0
            events.append(ev)
        return Answer(events, ttft)


def reference(engine, segs, query, mode="hypic", seam=SEAM):
    out = engine.prefill_segments(segs, query, mode=mode, seam=seam)
    return out.logits, engine.generate(out, max_new_tokens=N_TOKENS)


def assert_matches(ans: Answer, ref_logits, ref_tokens, n_segments: int, timings_events: int = 1) -> None:
    assert len(ans.segments) == n_segments
    assert sorted(s.index for s in ans.segments) == list(range(n_segments))
    assert len(ans.timings) == timings_events
    assert [t.index for t in ans.tokens] == list(range(N_TOKENS))
    assert list(ans.tokens[0].logits) and not any(t.logits for t in ans.tokens[1:])
    err = float((ans.logits - ref_logits).abs().max())
    assert err < TOL, err
    assert ans.token_ids == ref_tokens


def compositions(service: Service) -> tuple[float, float, float]:
    """hypic_combine_compositions_total for order "layer", "mixed" and "segment" (0 before the first)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{service.info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    found = {"layer": 0.0, "mixed": 0.0, "segment": 0.0}
    for line in body.splitlines():
        for order in found:
            if line.startswith(f'hypic_combine_compositions_total{{order="{order}"}} '):
                found[order] = float(line.split()[-1])
    return found["layer"], found["mixed"], found["segment"]


def executed_line(service: Service, request_id: str) -> dict:
    """The "executed" log line of one request."""
    lines = [json.loads(line) for line in service.log().splitlines()
             if line.startswith("{") and '"event": "executed"' in line]
    found = [d for d in lines if d.get("request_id") == request_id]
    assert len(found) == 1, found
    return found[0]


async def health(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                       timeout=10)
        return r.status


async def status_of(coro) -> grpc.StatusCode:
    """The status a call ends with (OK when it returns)."""
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def lookup_tiers(target: str, keys) -> list[int]:
    async with SegcacheClient(target) as sc:
        return [e.tier for e in await sc.lookup(keys)]
