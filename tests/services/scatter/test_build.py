"""The scatter worker as a process (tests/support/worker_mesh.py): its entries are byte-identical
to the in-process build, one build per key at a time, stored into segcache, dropped when nobody
waits, and bad Build requests get clean statuses while it keeps serving."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.engine.pic import SegmentEntry, segment_key
from common.engine.pic.seal import open_sealed
from common.mesh.segcache_client import SegcacheClient, checksum
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from tests.support.worker_mesh import (SEAM, SECRET, arun, build, build_request, health,
                                       lookup_tiers, prompt, status_of)

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]


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
            stub = scatter_grpc.ScatterStub(ch)
            # The blocker keeps the (single) build worker busy, so the two calls for `seg`
            # are surely in flight together.
            first = asyncio.create_task(build(mesh.scatter.target, build_request(engine, blocker)))
            while (await stub.Load(scatter_pb.LoadRequest(), timeout=10)).in_flight < 1:
                await asyncio.sleep(0.005)
            req = build_request(engine, seg, store=True, request_id="rid-single-flight")
            (h1, d1), (h2, d2) = await asyncio.gather(build(mesh.scatter.target, req),
                                                      build(mesh.scatter.target, req))
            await first
            load = await stub.Load(scatter_pb.LoadRequest(), timeout=10)
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
            stub = scatter_grpc.ScatterStub(ch)
            first = asyncio.create_task(build(mesh.scatter.target, build_request(engine, blocker)))
            while (await stub.Load(scatter_pb.LoadRequest(), timeout=10)).in_flight < 1:
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
                load = await stub.Load(scatter_pb.LoadRequest(), timeout=10)
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



def test_bad_builds_are_rejected_and_scatter_stays_up(mesh, engine):
    ids = prompt(9, (20,))[0][0]
    cases = {
        "key": (scatter_pb.BuildRequest(key="00" * 20, token_ids=ids, seam=SEAM,
                                 model_fingerprint=engine.fingerprint, dtype="float32"),
                grpc.StatusCode.INVALID_ARGUMENT),
        "vocab": (build_request(engine, [1, 600]), grpc.StatusCode.INVALID_ARGUMENT),
        "empty": (build_request(engine, []), grpc.StatusCode.INVALID_ARGUMENT),
        "no key": (scatter_pb.BuildRequest(token_ids=ids, seam=SEAM, model_fingerprint=engine.fingerprint,
                                    dtype="float32"), grpc.StatusCode.INVALID_ARGUMENT),
        "fingerprint": (scatter_pb.BuildRequest(key=segment_key("f" * 32, SEAM, "float32", ids),
                                         token_ids=ids, seam=SEAM, model_fingerprint="f" * 32,
                                         dtype="float32"), grpc.StatusCode.FAILED_PRECONDITION),
        "seam 2^31": (scatter_pb.BuildRequest(key="00" * 20, token_ids=ids, seam=2**31,
                                       model_fingerprint=engine.fingerprint, dtype="float32"),
                      grpc.StatusCode.INVALID_ARGUMENT),
    }

    async def run():
        got = {name: await status_of(build(mesh.scatter.target, req)) for name, (req, _) in cases.items()}
        return got, await health(mesh.scatter.target, "hypic.v1.Scatter"), await build(mesh.scatter.target,
                                                                                      build_request(engine, ids))

    got, status, (header, data) = arun(run())
    assert got == {name: want for name, (_, want) in cases.items()}
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert bytes(open_sealed(data, header.key, SECRET)) == engine.build_entry(ids, SEAM).to_bytes()
    assert mesh.scatter.alive()
