"""scatter + combine as real server processes on 127.0.0.1 (ephemeral ports), with a real
segcache, on a tiny random qwen3_5_text checkpoint.

One mesh per module (segcache, one scatter worker storing into it, one combine worker); the
reference answers come from HybridEngine.prefill_segments in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import struct
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

from common.engine.checksum import DIGEST_BYTES
from common.engine.checksum import checksum as entry_checksum
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import SegmentEntry, segment_key
from common.engine.pic.seal import open_sealed, seal
from common.mesh.nixl_util import load_nixl
from common.mesh.segcache_client import SegcacheClient, checksum
from protos.hypic.v1 import combine_pb2 as cpb
from protos.hypic.v1 import combine_pb2_grpc as cpb_grpc
from protos.hypic.v1 import router_pb2 as rpb
from protos.hypic.v1 import scatter_pb2 as spb
from protos.hypic.v1 import scatter_pb2_grpc as spb_grpc
from tests.support.tiny import PIC_CONFIGS, save_tiny

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 120
RPC_TIMEOUT_S = 60
SEAM = 8
N_TOKENS = 8
# The entry secret scatter and combine share (segcache here is left without it: entries are
# opaque bytes to it, so that combine's own checks are what is tested).
SECRET = os.urandom(32).hex().encode()
TOL = 1e-4

pytestmark = pytest.mark.timeout(240)


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


class Mesh:
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


@pytest.fixture(scope="module")
def workdir():
    # A private directory, not pytest's numbered tmp dirs: other pytest sessions running on the
    # same machine rotate those, and the servers' files must outlive them.
    d = Path(tempfile.mkdtemp(prefix="hypic-scatter-combine-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(workdir) -> Path:
    return save_tiny("qwen3_5_text", workdir / "model", seed=5, **PIC_CONFIGS["qwen3_5_text"])


@pytest.fixture(scope="module")
def mesh(request, workdir):
    tmp = workdir / "mesh"
    tmp.mkdir()
    m = Mesh(tmp, None)
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
        # combine: the default segcache (plans may leave it out), NIXL for every size of hit
        m.combine = m.start("combine", "services.combine", "--model", str(model_dir), "--threads", "1",
                            "--metrics-port", "0", "--segcache-address", m.segcache.target,
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


@pytest.fixture(scope="module")
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


def build_request(engine, ids, seam=SEAM, **kw) -> spb.BuildRequest:
    return spb.BuildRequest(key=segment_key(engine.fingerprint, seam, "float32", ids), token_ids=ids,
                            seam=seam, model_fingerprint=engine.fingerprint, dtype="float32", **kw)


async def build(target: str, req: spb.BuildRequest) -> tuple[spb.BuildHeader, bytes]:
    async with grpc.aio.insecure_channel(target) as ch:
        header, data = None, bytearray()
        async for msg in spb_grpc.ScatterStub(ch).Build(req, timeout=RPC_TIMEOUT_S):
            if msg.HasField("header"):
                header = msg.header
            data += msg.data
        return header, bytes(data)


def make_plan(engine, mesh, segs, query, source, *, mode=rpb.PREFILL_MODE_HYPIC, seam=SEAM,
              workers=None, scatter=None, segcache=None, **kw) -> cpb.Plan:
    key_seam = 0 if mode == rpb.PREFILL_MODE_ADDITIVE else seam
    planned = [cpb.PlannedSegment(key=segment_key(engine.fingerprint, key_seam, "float32", s), token_ids=s,
                                  source=source, worker=(workers[i] if workers else 0))
               for i, s in enumerate(segs)]
    args = dict(segments=planned, query=query, seam=seam, model_fingerprint=engine.fingerprint,
                dtype="float32", mode=mode, max_tokens=N_TOKENS, return_logits=True,
                scatter_addresses=[mesh.scatter.target] if scatter is None else scatter,
                segcache_address=mesh.segcache.target if segcache is None else segcache,
                store_entries=True)
    args.update(kw)
    return cpb.Plan(**args)


class Answer:
    def __init__(self, events, client_ttft_s: float):
        self.segments = [e.segment for e in events if e.HasField("segment")]
        self.tokens = [e.token for e in events if e.HasField("token")]
        self.timings = [e.timings for e in events if e.HasField("timings")]
        self.client_ttft_s = client_ttft_s

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    @property
    def logits(self) -> torch.Tensor:
        return torch.tensor(list(self.tokens[0].logits))

    def sources(self) -> list[int]:
        return [s.source for s in sorted(self.segments, key=lambda s: s.index)]


async def execute(target: str, plan: cpb.Plan, metadata=None, timeout: float = RPC_TIMEOUT_S) -> Answer:
    async with grpc.aio.insecure_channel(target) as ch:
        t0 = time.perf_counter()
        events, ttft = [], None
        async for ev in cpb_grpc.CombineStub(ch).Execute(plan, timeout=timeout, metadata=metadata):
            if ev.HasField("token") and ttft is None:
                ttft = time.perf_counter() - t0
            events.append(ev)
        return Answer(events, ttft)


def reference(engine, segs, query, mode="hypic", seam=SEAM):
    out = engine.prefill_segments(segs, query, mode=mode, seam=seam)
    return out.logits, engine.generate(out, max_new_tokens=N_TOKENS)


def assert_matches(ans: Answer, ref_logits, ref_tokens, n_segments: int) -> None:
    assert len(ans.segments) == n_segments
    assert sorted(s.index for s in ans.segments) == list(range(n_segments))
    assert len(ans.timings) == 1
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


# ---- scatter ------------------------------------------------------------------------------------
def test_scatter_build_is_byte_identical_to_in_process(mesh, engine):
    segs, _ = prompt(1, (45,))
    header, data = arun(build(mesh.scatter.target, build_request(engine, segs[0], chunk_bytes=4096)))
    expected = engine.build_entry(segs[0], SEAM).to_bytes()
    assert bytes(open_sealed(data, segment_key(engine.fingerprint, SEAM, "float32", segs[0]), SECRET)) == expected
    assert header.size == len(data) and header.checksum == checksum(data)
    assert header.key == segment_key(engine.fingerprint, SEAM, "float32", segs[0])
    assert not header.shared and header.worker.startswith("scatter@") and header.build_s > 0
    entry = SegmentEntry.from_bytes(bytes(open_sealed(data, header.key, SECRET)))
    assert entry.token_ids == segs[0] and entry.seam == SEAM and entry.model_fingerprint == engine.fingerprint


def test_scatter_single_flight_and_store(mesh, engine):
    (blocker, seg), _ = prompt(2, (3000, 64))

    async def run():
        async with grpc.aio.insecure_channel(mesh.scatter.target) as ch:
            stub = spb_grpc.ScatterStub(ch)
            # The blocker keeps the (single) build worker busy, so the two calls for `seg`
            # are surely in flight together.
            first = asyncio.create_task(build(mesh.scatter.target, build_request(engine, blocker)))
            while (await stub.Load(spb.LoadRequest(), timeout=10)).in_flight < 1:
                await asyncio.sleep(0.005)
            req = build_request(engine, seg, store=True, request_id="rid-single-flight")
            (h1, d1), (h2, d2) = await asyncio.gather(build(mesh.scatter.target, req),
                                                      build(mesh.scatter.target, req))
            await first
            load = await stub.Load(spb.LoadRequest(), timeout=10)
        async with SegcacheClient(mesh.segcache.target) as sc:
            stored = await sc.get(req.key)
        return h1, d1, h2, d2, load, stored

    h1, d1, h2, d2, load, stored = arun(run())
    assert sorted([h1.shared, h2.shared]) == [False, True]
    assert d1 == d2 and h1.build_s == h2.build_s
    assert load.in_flight == 0 and load.queued_tokens == 0 and load.model_fingerprint == engine.fingerprint
    assert stored is not None and bytes(stored) == d1  # stored once the stream ended
    builds = [line for line in mesh.scatter.log().splitlines()
              if '"event": "built"' in line and f'"key": "{h1.key}"' in line]
    assert len(builds) == 1, builds


def test_builds_nobody_waits_for_are_dropped(mesh, engine):
    """Callers that give up (deadline) on queued builds, store asked or not: those builds never
    run and nothing is stored for them; the running one finishes; Load drains to zero."""
    (blocker, *queued), _ = prompt(12, (8000, 200, 200, 200, 200, 200, 200))

    async def run():
        async with grpc.aio.insecure_channel(mesh.scatter.target) as ch:
            stub = spb_grpc.ScatterStub(ch)
            first = asyncio.create_task(build(mesh.scatter.target, build_request(engine, blocker)))
            while (await stub.Load(spb.LoadRequest(), timeout=10)).in_flight < 1:
                await asyncio.sleep(0.005)
            reqs = [build_request(engine, ids, store=i % 2 == 0) for i, ids in enumerate(queued)]

            async def give_up(req):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Build(req, timeout=0.2):
                        pass
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.gather(*(give_up(r) for r in reqs))
            await first
            for _ in range(200):
                load = await stub.Load(spb.LoadRequest(), timeout=10)
                if load.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        return reqs, load, await lookup_tiers(mesh.segcache.target, [r.key for r in reqs])

    reqs, load, tiers = arun(run())
    assert load.in_flight == 0 and load.queued_tokens == 0
    assert tiers == [0] * len(reqs)  # none was built and stored
    lines = [json.loads(x) for x in mesh.scatter.log().splitlines() if x.startswith("{")]
    built = {d.get("key") for d in lines if d.get("event") == "built"}
    assert built.isdisjoint(r.key for r in reqs)


# ---- combine ------------------------------------------------------------------------------------
def test_combine_cold_then_warm_matches_in_process(mesh, engine):
    segs, query = prompt(3, (40, 57, 33))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER)
    cold = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-cold-mesh")]))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    assert cold.sources() == [cpb.SOURCE_SCATTER] * 3
    assert all(s.worker.startswith("scatter@") and s.build_s > 0 for s in cold.segments)
    t = cold.timings[0]
    assert t.misses == 3 and t.hits == 0 and t.prompt_tokens == 135 and t.ttft_s > 0
    # arrived runs: each pass layer-major, its seams inside compose_s; the query folded into the last
    assert t.compose_s > 0 and t.seams_s == 0 and t.query_prefill_s == 0 and t.scatter_s > 0
    # the request id travelled combine -> scatter (metadata and BuildRequest)
    assert '"request_id": "rid-cold-mesh"' in mesh.scatter.log()

    warm_plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE, segcache="")  # combine's default
    warm = arun(execute(mesh.combine.target, warm_plan))
    assert_matches(warm, ref_logits, ref_tokens, len(segs))
    assert warm.sources() == [cpb.SOURCE_SEGCACHE] * 3
    w = warm.timings[0]
    assert w.hits == 3 and w.misses == 0
    assert all(s.tier == "host" for s in warm.segments), warm.segments
    assert dict(w.hits_by_tier) == {"host": 3}
    if load_nixl()[0] is not None and '"event": "nixl ready"' in mesh.combine.log():
        assert all(s.via_nixl for s in warm.segments)
    print(f"\n[ttft] cold (3 misses via scatter): server {t.ttft_s * 1e3:.1f} ms, "
          f"client {cold.client_ttft_s * 1e3:.1f} ms | warm (3 hits, nixl={warm.segments[0].via_nixl}): "
          f"server {w.ttft_s * 1e3:.1f} ms, client {warm.client_ttft_s * 1e3:.1f} ms")

    # metrics: stage histograms and segments by source
    body = urllib.request.urlopen(f"http://127.0.0.1:{mesh.combine.info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    assert 'hypic_combine_stage_seconds_bucket{le="0.001",stage="compose_run"}' in body
    assert 'hypic_combine_segments_total{source="scatter",via="grpc"} 3.0' in body
    assert 'hypic_combine_segments_total{source="segcache"' in body


def test_combine_baseline_modes(mesh, engine):
    segs, query = prompt(4, (30, 21))
    for mode, name in ((rpb.PREFILL_MODE_FULL, "full"), (rpb.PREFILL_MODE_PREFIX, "prefix"),
                       (rpb.PREFILL_MODE_ADDITIVE, "additive")):
        ref_logits, ref_tokens = reference(engine, segs, query, mode=name)
        ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER,
                                                          mode=mode)))
        # full and prefix recompute on the combine worker: no segment events
        assert_matches(ans, ref_logits, ref_tokens, len(segs) if name == "additive" else 0)
    # sampling: the same tokens as engine.generate with the same seed, temperature and top_k
    out = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    want = engine.generate(out, max_new_tokens=N_TOKENS, temperature=0.8, top_k=20, seed=1234)
    ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE,
                                                      temperature=0.8, top_k=20, seed=1234)))
    assert ans.token_ids == want


# ---- composition order --------------------------------------------------------------------------
def test_combine_warm_plan_composes_layer_major(mesh, engine, model_dir):
    # many short segments (the agent shape), one shorter than the seam
    segs, query = prompt(12, (14, 6, 23, 11, 17, 9))
    n = len(segs)
    ref_logits, ref_tokens = reference(engine, segs, query)
    # the same model, always segment-major; it loads while the cold request runs
    seg_worker = mesh.start("combine-segment", "services.combine", "--model", str(model_dir),
                            "--threads", "1", "--compose-order", "segment",
                            "--entry-key-file", str(mesh.tmp / "entry.key"))
    layer0, mixed0, segment0 = compositions(mesh.combine)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER)))
    assert_matches(cold, ref_logits, ref_tokens, n)  # and every entry is now in segcache

    warm_plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE)
    warm = arun(execute(mesh.combine.target, warm_plan, metadata=[("x-request-id", "rid-warm-layer")]))
    assert_matches(warm, ref_logits, ref_tokens, n)
    w = warm.timings[0]
    assert w.hits == n and w.misses == 0
    assert w.seams_s == 0 and w.compose_s > 0  # one pass: the seams are inside compose_s
    assert compositions(mesh.combine) == (layer0 + 1, mixed0, segment0 + 1)
    assert executed_line(mesh.combine, "rid-warm-layer")["compose_order"] == "layer"

    seg_worker.wait()
    seg = arun(execute(seg_worker.target, warm_plan, metadata=[("x-request-id", "rid-warm-segment")]))
    assert_matches(seg, ref_logits, ref_tokens, n)
    assert seg.timings[0].hits == n and seg.timings[0].seams_s > 0
    assert float((warm.logits - seg.logits).abs().max()) < TOL and warm.token_ids == seg.token_ids
    assert executed_line(seg_worker, "rid-warm-segment")["compose_order"] == "segment"
    assert seg_worker.terminate() == 0

    # planned as all hits, but segcache never saw segment 3: scatter builds it, and the one
    # layer-major pass runs once it is in
    lost = prompt(13, (19,))[0]
    segs2 = segs[:3] + lost + segs[3:]
    ref_logits, ref_tokens = reference(engine, segs2, query)
    ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs2, query, cpb.SOURCE_SEGCACHE)))
    assert_matches(ans, ref_logits, ref_tokens, n + 1)
    assert ans.sources() == [cpb.SOURCE_SEGCACHE] * 3 + [cpb.SOURCE_SCATTER] + [cpb.SOURCE_SEGCACHE] * 3
    t = ans.timings[0]
    assert t.hits == n and t.misses == 1 and t.seams_s == 0 and t.scatter_s > 0
    assert compositions(mesh.combine) == (layer0 + 2, mixed0, segment0 + 1)


def test_combine_plan_with_misses_composes_as_they_arrive(mesh, engine):
    segs, query = prompt(14, (27, 12, 33))
    layer0, mixed0, segment0 = compositions(mesh.combine)
    # all misses (built by scatter, and stored)
    ref_logits, ref_tokens = reference(engine, segs, query)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER),
                        metadata=[("x-request-id", "rid-cold-segment")]))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    assert cold.timings[0].misses == len(segs) and cold.timings[0].compose_s > 0
    executed = executed_line(mesh.combine, "rid-cold-segment")
    # runs of whatever had arrived, in prompt order (arrival timing decides their sizes)
    assert executed["compose_order"] == "segment" and sum(executed["compose_runs"]) == len(segs)
    assert compositions(mesh.combine) == (layer0, mixed0, segment0 + 1)
    # a planned miss first: nothing to compose layer-major before it, so all as they arrive
    fresh0, fresh1 = prompt(15, (16, 21))[0]
    segs2 = [fresh0] + segs
    plan = make_plan(engine, mesh, segs2, query, cpb.SOURCE_SEGCACHE)
    plan.segments[0].source = cpb.SOURCE_SCATTER
    ref_logits, ref_tokens = reference(engine, segs2, query)
    ans = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-miss-first")]))
    assert_matches(ans, ref_logits, ref_tokens, len(segs2))
    assert ans.sources() == [cpb.SOURCE_SCATTER] + [cpb.SOURCE_SEGCACHE] * 3
    assert ans.timings[0].hits == 3
    executed = executed_line(mesh.combine, "rid-miss-first")
    assert executed["compose_order"] == "segment" and sum(executed["compose_runs"]) == len(segs2)
    assert compositions(mesh.combine) == (layer0, mixed0, segment0 + 2)
    # hits, a planned miss, a hit: the leading two hits in one layer-major pass, then the miss
    # and the last hit as they arrive
    segs3 = segs[:2] + [fresh1] + segs[2:]
    plan = make_plan(engine, mesh, segs3, query, cpb.SOURCE_SEGCACHE)
    plan.segments[2].source = cpb.SOURCE_SCATTER
    ref_logits, ref_tokens = reference(engine, segs3, query)
    ans = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-mixed")]))
    assert_matches(ans, ref_logits, ref_tokens, len(segs3))
    assert ans.sources() == [cpb.SOURCE_SEGCACHE] * 2 + [cpb.SOURCE_SCATTER, cpb.SOURCE_SEGCACHE]
    assert ans.timings[0].hits == 3
    executed = executed_line(mesh.combine, "rid-mixed")
    assert executed["compose_order"] == "mixed" and executed["compose_runs"][0] == 2
    assert sum(executed["compose_runs"]) == len(segs3)
    assert compositions(mesh.combine) == (layer0, mixed0 + 1, segment0 + 2)


def test_combine_additive_all_hits_stays_segment_major(mesh, engine):
    segs, query = prompt(16, (24, 13, 30))
    ref_logits, ref_tokens = reference(engine, segs, query, mode="additive")
    layer0, mixed0, segment0 = compositions(mesh.combine)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER,
                                                       mode=rpb.PREFILL_MODE_ADDITIVE)))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    # the seam-0 entries are in segcache now; layer-major would add them with T, not additively
    warm = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE,
                                                       mode=rpb.PREFILL_MODE_ADDITIVE),
                        metadata=[("x-request-id", "rid-warm-additive")]))
    assert_matches(warm, ref_logits, ref_tokens, len(segs))
    assert warm.timings[0].hits == len(segs)
    assert compositions(mesh.combine) == (layer0, mixed0, segment0 + 2)
    executed = executed_line(mesh.combine, "rid-warm-additive")
    assert executed["compose_order"] == "segment" and executed["mode"] == "additive"


class GatedScatter(spb_grpc.ScatterServicer):
    """A scatter worker that builds real entries (this process's engine, sealed with the mesh's
    secret) and answers segment i only `delay_s[i]` after its call began: arrival orders chosen
    by the test."""

    def __init__(self, engine, segs, delay_s):
        self.engine, self.delay_s = engine, delay_s
        self.index = {tuple(s): i for i, s in enumerate(segs)}

    async def Build(self, request, context):
        t0 = time.perf_counter()
        i = self.index[tuple(request.token_ids)]
        data = seal(self.engine.build_entry(list(request.token_ids), request.seam).to_bytes(), SECRET)
        await asyncio.sleep(max(0.0, self.delay_s[i] - (time.perf_counter() - t0)))
        header = spb.BuildHeader(key=request.key, size=len(data), worker="gated", checksum=checksum(data))
        yield spb.BuildResponse(header=header, data=data)


async def execute_gated(engine, mesh, target, segs, query, delay_s, rid):
    server = grpc.aio.server()
    spb_grpc.add_ScatterServicer_to_server(GatedScatter(engine, segs, delay_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER, scatter=[f"127.0.0.1:{port}"],
                         store_entries=False)
        return await execute(target, plan, metadata=[("x-request-id", rid)])
    finally:
        await server.stop(0)


def test_combine_composes_arrived_runs_equal_to_segment_major(mesh, engine, model_dir, fresh_seed):
    """Entries arriving in random orders are composed in runs of consecutive arrived segments:
    the same logits and tokens as the in-process reference and as a worker composing segment by
    segment (--compose-order segment, the plain path)."""
    rng = random.Random(fresh_seed)
    seg_worker = mesh.start("combine-runs-ref", "services.combine", "--model", str(model_dir),
                            "--threads", "1", "--compose-order", "segment",
                            "--entry-key-file", str(mesh.tmp / "entry.key"))
    lengths = [rng.choice([3, 7, 9, 13]) if rng.random() < 0.3 else rng.randint(15, 70) for _ in range(7)]
    segs, query = prompt(fresh_seed % 100_000 + 1000, lengths)
    ref_logits, ref_tokens = reference(engine, segs, query)
    n = len(segs)
    # segment 0 last, well after the others: when it arrives everything is in hand, one run of n
    delays = [1.2] + [rng.uniform(0.0, 0.4) for _ in range(n - 1)]
    ans = arun(execute_gated(engine, mesh, mesh.combine.target, segs, query, delays, f"rid-runs-{fresh_seed}"))
    assert_matches(ans, ref_logits, ref_tokens, n)
    assert ans.sources() == [cpb.SOURCE_SCATTER] * n and ans.timings[0].seams_s == 0
    assert executed_line(mesh.combine, f"rid-runs-{fresh_seed}")["compose_runs"] == [n]
    # random arrival orders in batches a quarter second apart: runs of whatever is in hand
    seg_worker.wait()
    for k in range(2):
        order = list(range(n))
        rng.shuffle(order)
        delays = [0.0] * n
        t, j = 0.0, 0
        while j < n:
            step = rng.randint(1, 3)
            for i in order[j:j + step]:
                delays[i] = t
            t, j = t + 0.25, j + step
        rid = f"rid-runs-{fresh_seed}-{k}"
        ans = arun(execute_gated(engine, mesh, mesh.combine.target, segs, query, delays, rid))
        seg = arun(execute_gated(engine, mesh, seg_worker.target, segs, query, delays, rid + "-ref"))
        assert_matches(ans, ref_logits, ref_tokens, n)
        assert_matches(seg, ref_logits, ref_tokens, n)
        assert float((ans.logits - seg.logits).abs().max()) < TOL and ans.token_ids == seg.token_ids
        runs = executed_line(mesh.combine, rid)["compose_runs"]
        assert sum(runs) == n and all(r >= 1 for r in runs)
        assert executed_line(seg_worker, rid + "-ref")["compose_runs"] == [1] * n
    assert seg_worker.terminate() == 0


def test_compose_order_config(monkeypatch, capsys):
    from common.mesh.config import ConfigError, load_config
    from services.combine.__main__ import main
    from services.combine.config import ENV_PREFIX, CombineConfig

    model = ["--model", "some-model-dir"]

    def load(argv=(), **env) -> CombineConfig:
        return load_config(CombineConfig, [*model, *argv], env=env, env_prefix=ENV_PREFIX)

    assert load().compose_order == "auto"
    assert load(HYPIC_COMBINE_COMPOSE_ORDER="segment").compose_order == "segment"
    assert load(["--compose-order", "auto"], HYPIC_COMBINE_COMPOSE_ORDER="segment").compose_order == "auto"
    with pytest.raises(ConfigError, match=r"HYPIC_COMBINE_COMPOSE_ORDER.*\('auto', 'segment'\), not 'layer'"):
        load(HYPIC_COMBINE_COMPOSE_ORDER="layer")
    # the worker refuses to start (before loading any model) and says why
    monkeypatch.setenv("HYPIC_COMBINE_COMPOSE_ORDER", "Segment")
    assert main(model) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "compose_order" in err and "'Segment'" in err


# A scatter worker killed mid-stream: it sends the header and half the bytes, then exits.
DYING_SCATTER = r"""
import asyncio, json, os, sys
import grpc
from protos.hypic.v1 import scatter_pb2 as spb, scatter_pb2_grpc as spb_grpc

class Dying(spb_grpc.ScatterServicer):
    async def Build(self, request, context):
        data = os.urandom(20000)
        yield spb.BuildResponse(header=spb.BuildHeader(key=request.key, size=len(data), worker="dying"),
                                data=data[:10000])
        await asyncio.sleep(0.2)
        os._exit(17)

async def main():
    server = grpc.aio.server()
    spb_grpc.add_ScatterServicer_to_server(Dying(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"port": port}, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    await server.wait_for_termination()

asyncio.run(main())
"""


class WrongScatter(spb_grpc.ScatterServicer):
    """A scatter worker that answers with a valid entry of other tokens, sealed with the mesh's
    secret (a worker that has it, but a bug)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    async def Build(self, request, context):
        self.calls += 1
        data = seal(self.engine.build_entry(list(request.token_ids)[:-1], request.seam).to_bytes(), SECRET)
        header = spb.BuildHeader(key=request.key, size=len(data), worker="wrong", checksum=checksum(data))
        yield spb.BuildResponse(header=header, data=data)


def test_combine_falls_back_from_failing_scatter_workers(mesh, engine):
    segs, query = prompt(5, (26, 35))
    ref_logits, ref_tokens = reference(engine, segs, query)
    # worker 0 is dead: the next address builds them
    plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER, scatter=[mesh.dead, mesh.scatter.target],
                     workers=[0, 0])
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [cpb.SOURCE_SCATTER] * 2
    assert all(s.worker.startswith("scatter@") for s in ans.segments)

    # worker 0 dies mid-stream, worker 1 sends another segment's entry: built on the combine
    segs, query = prompt(6, (19, 44))
    ref_logits, ref_tokens = reference(engine, segs, query)
    dying = mesh.start_argv("dying", ["-c", DYING_SCATTER, str(mesh.tmp / "dying.port.json")]).wait()

    async def run():
        wrong = WrongScatter(engine)
        server = grpc.aio.server()
        spb_grpc.add_ScatterServicer_to_server(wrong, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER,
                             scatter=[dying.target, f"127.0.0.1:{port}"], workers=[0, 0], store_entries=False)
            return await execute(mesh.combine.target, plan), wrong.calls
        finally:
            await server.stop(0)

    ans, wrong_calls = arun(run())
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [cpb.SOURCE_LOCAL] * 2 and wrong_calls == 2
    assert dying.proc.wait(timeout=10) == 17  # it really died mid-stream
    log = mesh.combine.log()
    assert '"reason": "forged"' in log and ('"reason": "short"' in log or '"reason": "unavailable"' in log)

    # the only scatter address is dead and so is segcache: built on the combine worker
    segs, query = prompt(11, (23, 17))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER, scatter=[mesh.dead], segcache=mesh.dead)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [cpb.SOURCE_LOCAL] * 2


def test_combine_falls_back_when_segcache_fails(mesh, engine):
    # unreachable segcache: the misses go to scatter
    segs, query = prompt(7, (31, 28))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE, segcache=mesh.dead)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [cpb.SOURCE_SCATTER] * 2
    # corrupt bytes (sealed after the damage: a payload whose layout does not parse) and a sealed
    # valid entry of other tokens under the planned keys: both rebuilt, and both dropped from segcache
    segs, query = prompt(8, (22, 37))
    ref_logits, ref_tokens = reference(engine, segs, query)
    keys = [segment_key(engine.fingerprint, SEAM, "float32", s) for s in segs]
    other = seal(engine.build_entry(segs[0][:10], SEAM).to_bytes(), SECRET)
    bad = bytearray(engine.build_entry(segs[0], SEAM).to_bytes())
    payload_at = 8 + struct.unpack("<I", bad[4:8])[0]  # the safetensors header length, made too long
    bad[payload_at:payload_at + 8] = struct.pack("<Q", len(bad))

    async def put():
        async with SegcacheClient(mesh.segcache.target) as sc:
            await sc.put(keys[0], seal(bytes(bad), SECRET))
            await sc.put(keys[1], other)
    arun(put())
    plan = make_plan(engine, mesh, segs, query, cpb.SOURCE_SEGCACHE, store_entries=False)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [cpb.SOURCE_SCATTER] * 2
    assert arun(lookup_tiers(mesh.segcache.target, keys)) == [0, 0]  # dropped
    log = mesh.combine.log()
    assert '"reason": "corrupt"' in log and '"reason": "forged"' in log


async def lookup_tiers(target: str, keys) -> list[int]:
    async with SegcacheClient(target) as sc:
        return [e.tier for e in await sc.lookup(keys)]


def rewritten_header(entry_bytes: bytes, token_ids) -> bytes:
    """Entry bytes whose header claims `token_ids` (the payload unchanged): the poisoning of #14.
    The entry's own digest is unkeyed, so the forger recomputes it: this parses as a sound entry."""
    (n,) = struct.unpack("<I", entry_bytes[4:8])
    header = json.loads(entry_bytes[8:8 + n])
    header["token_ids"] = list(token_ids)
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = entry_bytes[:4] + struct.pack("<I", len(hb)) + hb + entry_bytes[8 + n:-DIGEST_BYTES]
    return body + entry_checksum(body)


def test_forged_entries_are_never_an_answer_and_never_block_their_key(mesh, engine, fresh_seed):
    """A document's entry with one fact changed, its header rewritten to the victim's tokens and
    Put under the victim's key (unsealed, sealed with a guessed secret, and sealed without one):
    the victim's answer stays its own, the forgery is dropped, and the rebuilt entry is stored."""
    g = torch.Generator().manual_seed(fresh_seed)
    victims = [torch.randint(1, 512, (30,), generator=g).tolist() for _ in range(3)]
    query = torch.randint(0, 512, (4,), generator=g).tolist()
    keys = [segment_key(engine.fingerprint, SEAM, "float32", v) for v in victims]
    forged = []
    for v in victims:
        changed = list(v)
        changed[7] = (changed[7] + 1) % 512  # the attacker's document: one fact differs
        poison = rewritten_header(engine.build_entry(changed, SEAM).to_bytes(), v)
        assert SegmentEntry.from_bytes(poison).token_ids == v  # it would pass every old check
        forged.append(poison)
    forged = [forged[0], seal(forged[1], os.urandom(32)), seal(forged[2], b"")]

    async def put():
        async with SegcacheClient(mesh.segcache.target) as sc:
            for k, data in zip(keys, forged):
                assert (await sc.put(k, data)).created
    arun(put())
    for i, v in enumerate(victims):
        ref_logits, ref_tokens = reference(engine, [v], query)
        plan = make_plan(engine, mesh, [v], query, cpb.SOURCE_SEGCACHE)
        ans = arun(execute(mesh.combine.target, plan))
        assert_matches(ans, ref_logits, ref_tokens, 1)
        assert ans.sources() == [cpb.SOURCE_SCATTER], i
    # The forgeries are gone and the scatter's rebuilds took their keys: sealed, the victims' own.
    async def stored() -> list[bytes]:
        async with SegcacheClient(mesh.segcache.target) as sc:
            return [await sc.get(k) for k in keys]
    for k, v, data in zip(keys, victims, arun(stored())):
        assert data is not None, "the rebuilt entry was not stored: the key stayed blocked"
        assert SegmentEntry.from_bytes(bytes(open_sealed(data, k, SECRET))).token_ids == v
    port = mesh.combine.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    dropped = [line for line in text.splitlines() if line.startswith('hypic_combine_entries_dropped_total{reason="forged"}')]
    assert dropped and float(dropped[0].split()[-1]) >= 3, dropped


def test_bad_plans_are_rejected_and_services_stay_up(mesh, engine):
    segs, query = prompt(9, (20, 20))

    def plan(**kw):
        p = make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER)
        for name, value in kw.items():
            if isinstance(value, list):
                p.ClearField(name)
                getattr(p, name).extend(value)
            else:
                setattr(p, name, value)
        return p

    bad_seg = cpb.PlannedSegment(token_ids=[1, 2, 512], source=cpb.SOURCE_SCATTER)
    cases = {
        "no segments": (plan(segments=[]), grpc.StatusCode.INVALID_ARGUMENT),
        "empty query": (plan(query=[]), grpc.StatusCode.INVALID_ARGUMENT),
        "token >= vocab": (plan(segments=[bad_seg]), grpc.StatusCode.INVALID_ARGUMENT),
        "query token >= vocab": (plan(query=[3, 9999]), grpc.StatusCode.INVALID_ARGUMENT),
        "max_tokens 0": (plan(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        "unknown worker": (make_plan(engine, mesh, segs, query, cpb.SOURCE_SCATTER, workers=[0, 3]),
                           grpc.StatusCode.INVALID_ARGUMENT),
        "wrong key": (plan(segments=[cpb.PlannedSegment(key="ab" * 20, token_ids=segs[0])]),
                      grpc.StatusCode.INVALID_ARGUMENT),
        "fingerprint": (plan(model_fingerprint="0" * 32), grpc.StatusCode.FAILED_PRECONDITION),
        "dtype": (plan(dtype="bfloat16"), grpc.StatusCode.FAILED_PRECONDITION),
        "unknown mode": (plan(mode=9), grpc.StatusCode.INVALID_ARGUMENT),
        "seam 2^31": (plan(seam=2**31), grpc.StatusCode.INVALID_ARGUMENT),
        "denormal temperature": (plan(temperature=1e-45), grpc.StatusCode.INVALID_ARGUMENT),
    }

    async def code_of(coro):
        try:
            await coro
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    async def run():
        got = {name: await code_of(execute(mesh.combine.target, p)) for name, (p, _) in cases.items()}
        ids = segs[0]
        bad_builds = {
            "scatter key": (spb.BuildRequest(key="00" * 20, token_ids=ids, seam=SEAM,
                                             model_fingerprint=engine.fingerprint, dtype="float32"),
                            grpc.StatusCode.INVALID_ARGUMENT),
            "scatter vocab": (build_request(engine, [1, 600]), grpc.StatusCode.INVALID_ARGUMENT),
            "scatter empty": (build_request(engine, []), grpc.StatusCode.INVALID_ARGUMENT),
            "scatter no key": (spb.BuildRequest(token_ids=ids, seam=SEAM, model_fingerprint=engine.fingerprint,
                                                dtype="float32"), grpc.StatusCode.INVALID_ARGUMENT),
            "scatter fingerprint": (spb.BuildRequest(key=segment_key("f" * 32, SEAM, "float32", ids),
                                                     token_ids=ids, seam=SEAM, model_fingerprint="f" * 32,
                                                     dtype="float32"), grpc.StatusCode.FAILED_PRECONDITION),
            "scatter seam 2^31": (spb.BuildRequest(key="00" * 20, token_ids=ids, seam=2**31,
                                                   model_fingerprint=engine.fingerprint, dtype="float32"),
                                  grpc.StatusCode.INVALID_ARGUMENT),
        }
        for name, (req, want) in bad_builds.items():
            got[name] = await code_of(build(mesh.scatter.target, req))
            cases[name] = (req, want)
        # a cancelled request leaves nothing running behind
        big, _ = prompt(10, (2500, 2500))
        async with grpc.aio.insecure_channel(mesh.combine.target) as ch:
            stub = cpb_grpc.CombineStub(ch)
            call = stub.Execute(make_plan(engine, mesh, big, query, cpb.SOURCE_LOCAL), timeout=60)
            await asyncio.sleep(0.3)
            call.cancel()
            for _ in range(400):
                info = await stub.Info(cpb.CombineInfoRequest(), timeout=10)
                if info.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        # still serving, and still right
        statuses = [await health(mesh.combine.target, "hypic.v1.Combine"),
                    await health(mesh.scatter.target, "hypic.v1.Scatter")]
        ok = await execute(mesh.combine.target, plan())
        return got, info, statuses, ok

    got, info, statuses, ok = arun(run())
    assert got == {name: want for name, (_, want) in cases.items()}
    assert info.in_flight == 0 and info.model_fingerprint == engine.fingerprint and info.dtype == "float32"
    assert info.model_type == "qwen3_5_text"
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    ref_logits, ref_tokens = reference(engine, segs, query)
    assert_matches(ok, ref_logits, ref_tokens, len(segs))
    assert mesh.combine.alive() and mesh.scatter.alive() and mesh.segcache.alive()
