"""The mesh end to end: real processes on 127.0.0.1 started by hypic.launcher.Mesh.

Answers equal the in-process engine, LPT splits skewed cold segments, faults degrade gracefully,
bad input gets clear status codes, and a load of concurrent clients completes."""
from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

import hypic
from common.engine.hybrid_engine import HybridEngine
from hypic.launcher import Mesh
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from tests.support.tiny import PIC_CONFIGS, save_tiny
from tests.support.worker_mesh import FP32_ENTRIES_ENV

pytestmark = pytest.mark.processes

SEAM = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=5, **PIC_CONFIGS["qwen3_5_text"])


@pytest.fixture(scope="module")
def engine(model) -> HybridEngine:
    return HybridEngine.from_pretrained(model)


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    with Mesh(model, tmp_path_factory.mktemp("data"), n_scatter=2, threads=1, seam=SEAM,
              start_timeout_s=180, env=FP32_ENTRIES_ENV, extra_args={"router": ["--max-prompt-tokens", "6000"]}) as m:
        yield m
    assert m.exit_codes and all(c == 0 for c in m.exit_codes.values()), m.exit_codes  # clean SIGTERM exits


def docs(seed: int, lengths) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(1, 500) for _ in range(n)] for n in lengths]


def reference(engine, segs, query, max_tokens=8):
    out = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    return out.logits, engine.generate(out, max_new_tokens=max_tokens)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_answers_equal_in_process_cold_and_warm(mesh, engine):
    segs, query = docs(1, (40, 9, 63, 17, 30)), [5, 6, 7, 8]
    ref_logits, ref_tokens = reference(engine, segs, query)
    with hypic.Client(mesh.router_address, timeout=120) as c:
        cold = c.generate(segments=segs, query=query, max_tokens=8, stream=False, return_logits=True)
        assert cold.timings.misses == len(segs) and cold.timings.hits == 0
        warm = c.generate(segments=segs, query=query, max_tokens=8, stream=False, return_logits=True)
        assert warm.timings.hits == len(segs) and warm.timings.misses == 0
    for res in (cold, warm):
        assert (torch.tensor(res.logits) - ref_logits).abs().max() < 1e-4
        assert res.tokens == ref_tokens


def test_lpt_splits_skewed_cold_segments(mesh):
    """One long segment and six short ones on m = 2 workers: LPT gives the long one a worker of
    its own and the short ones to the other (round-robin or contiguous halves would put the long
    one with three others)."""
    segs = docs(2, (600, 40, 40, 40, 40, 40, 40))
    with hypic.Client(mesh.router_address, timeout=120) as c:
        res = c.generate(segments=segs, query=[3, 4], max_tokens=1, stream=False)
    trace = res.timings.trace
    assert len(trace) == len(segs) and all(t.source == "scatter" for t in trace)
    long_worker = trace[0].worker
    with_long = [t.index for t in trace if t.worker == long_worker]
    others = [t.index for t in trace if t.worker != long_worker]
    assert others, "both workers must get work"
    assert len(with_long) < len(others), (with_long, others)


def test_scatter_killed_before_and_during_a_request(mesh, engine):
    with hypic.Client(mesh.router_address, timeout=120) as c:
        # killed before the router notices: its misses are re-dispatched
        mesh.kill("scatter0")
        segs, query = docs(3, (50, 70, 30, 90)), [9, 9]
        _, ref_tokens = reference(engine, segs, query, 4)
        res = c.generate(segments=segs, query=query, max_tokens=4, stream=False)
        assert res.tokens == ref_tokens
        dead_worker = f"scatter@{mesh['scatter0'].address}"
        assert all(t.source in ("scatter", "local") for t in res.timings.trace)
        assert not any(t.worker == dead_worker for t in res.timings.trace), res.timings.trace
        mesh.restart("scatter0")
        # killed while a cold request is being built
        segs, query = docs(4, [300] * 16), [1, 2, 3]
        _, ref_tokens = reference(engine, segs, query, 4)
        killer = threading.Timer(0.3, mesh.kill, args=("scatter1",))
        killer.start()
        res = c.generate(segments=segs, query=query, max_tokens=4, stream=False)
        killer.join()
        assert res.tokens == ref_tokens
        mesh.restart("scatter1")


def test_segcache_down_still_answers(mesh, engine):
    with hypic.Client(mesh.router_address, timeout=120) as c:
        segs, query = docs(5, (33, 44)), [7]
        c.generate(segments=segs, query=query, max_tokens=2, stream=False)  # cached now
        mesh.kill("segcache")
        try:
            for s in (segs, docs(6, (21, 12))):  # cached before, and new
                _, ref_tokens = reference(engine, s, query, 3)
                res = c.generate(segments=s, query=query, max_tokens=3, stream=False)
                assert res.tokens == ref_tokens
                assert res.timings.hits == 0
        finally:
            mesh.restart("segcache")


def test_combine_unavailable_is_unavailable_within_the_deadline(model, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with Mesh(model, tmp_path / "data", n_scatter=0, n_combine=0, segcache=False, external_combine=[dead],
              start_timeout_s=120) as m:
        with hypic.Client(m.router_address) as c:
            t0 = time.monotonic()
            with pytest.raises(hypic.errors.Unavailable):
                c.generate(segments=[[1, 2, 3]], query=[4], max_tokens=2, stream=False, timeout=10)
            assert time.monotonic() - t0 < 10


def _bad(stub, **kw):
    req = router_pb.GenerateRequest(**kw)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    return e.value.code()


def test_bad_input_gets_clear_status_and_services_stay_up(mesh, engine):
    seg = router_pb.Segment(token_ids=[1, 2, 3])
    with grpc.insecure_channel(mesh.router_address) as ch:
        stub = router_grpc.RouterStub(ch)
        assert _bad(stub, segments=[], query=seg, max_tokens=2) == grpc.StatusCode.INVALID_ARGUMENT
        assert _bad(stub, segments=[router_pb.Segment()], query=seg, max_tokens=2) == grpc.StatusCode.INVALID_ARGUMENT
        assert _bad(stub, segments=[router_pb.Segment(token_ids=[engine.vocab_size])], query=seg,
                    max_tokens=2) == grpc.StatusCode.INVALID_ARGUMENT
        assert _bad(stub, segments=[seg], query=seg, max_tokens=0) == grpc.StatusCode.INVALID_ARGUMENT
        assert _bad(stub, segments=[router_pb.Segment(token_ids=[1] * 6100)], query=seg,
                    max_tokens=2) == grpc.StatusCode.INVALID_ARGUMENT
    garbage = random.Random(0).randbytes(10 << 20)
    for name, addr in mesh.addresses.items():
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            try:
                sock.sendall(garbage)
            except OSError:
                pass  # the server may hang up on the first bad frame: that is fine
    time.sleep(0.5)
    assert mesh.dead() == []
    mesh.wait_healthy(timeout_s=30)
    segs, query = docs(7, (20, 20)), [2]
    _, ref_tokens = reference(engine, segs, query, 2)
    with hypic.Client(mesh.router_address, timeout=60) as c:
        assert c.generate(segments=segs, query=query, max_tokens=2, stream=False).tokens == ref_tokens


def test_load_50_clients_x_20_requests(mesh):
    pool = docs(8, [random.Random(i).randrange(20, 80) for i in range(24)])
    pids = {name: mesh[name].pid for name in mesh.names}
    before = {name: rss_mb(pid) for name, pid in pids.items()}

    async def client(i: int) -> int:
        rng = random.Random(100 + i)
        done = 0
        async with hypic.AsyncClient(mesh.router_address, timeout=300) as c:
            for _ in range(20):
                segs = rng.sample(pool, 3)
                res = await c.generate(segments=segs, query=[rng.randrange(1, 500)], max_tokens=2, stream=False)
                assert len(res.tokens) == 2
                done += 1
        return done

    async def main():
        return await asyncio.gather(*(client(i) for i in range(50)))

    t0 = time.monotonic()
    counts = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert sum(counts) == 1000
    after = {name: rss_mb(pid) for name, pid in pids.items()}
    growth = {n: after[n] - before[n] for n in pids}
    print(f"\n1000 requests in {elapsed:.1f}s; RSS growth MB: {growth}")
    assert all(g < 400 for g in growth.values()), growth
    assert mesh.dead() == []
