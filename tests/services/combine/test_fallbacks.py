"""The combine worker when its neighbours or its callers misbehave (tests/support/worker_mesh.py):
dead, dying and wrong scatter workers and a failing segcache are built around, forged entries are
never an answer and never block their key, and bad plans get clean statuses while it keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from common.engine.checksum import DIGEST_BYTES
from common.engine.checksum import checksum as entry_checksum
from common.engine.pic import SegmentEntry, segment_key
from common.engine.pic.seal import open_sealed, seal
from common.mesh.segcache_client import SegcacheClient, checksum
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from tests.support.worker_mesh import (SEAM, SECRET, arun, assert_matches, execute, health,
                                       lookup_tiers, make_plan, prompt, reference, status_of)

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]


# A scatter worker killed mid-stream: it sends the header and half the bytes, then exits.
DYING_SCATTER = r"""
import asyncio, json, os, sys
import grpc
from protos.hypic.v1 import scatter_pb2 as scatter_pb, scatter_pb2_grpc as scatter_grpc

class Dying(scatter_grpc.ScatterServicer):
    async def Build(self, request, context):
        data = os.urandom(20000)
        yield scatter_pb.BuildResponse(header=scatter_pb.BuildHeader(key=request.key, size=len(data), worker="dying"),
                                data=data[:10000])
        await asyncio.sleep(0.2)
        os._exit(17)

async def main():
    server = grpc.aio.server()
    scatter_grpc.add_ScatterServicer_to_server(Dying(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"port": port}, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    await server.wait_for_termination()

asyncio.run(main())
"""


class WrongScatter(scatter_grpc.ScatterServicer):
    """A scatter worker that answers with a valid entry of other tokens, sealed with the mesh's
    secret (a worker that has it, but a bug)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    async def Build(self, request, context):
        self.calls += 1
        data = seal(self.engine.build_entry(list(request.token_ids)[:-1], request.seam).to_bytes(), SECRET)
        header = scatter_pb.BuildHeader(key=request.key, size=len(data), worker="wrong", checksum=checksum(data))
        yield scatter_pb.BuildResponse(header=header, data=data)


def test_combine_falls_back_from_failing_scatter_workers(mesh, engine):
    segs, query = prompt(5, (26, 35))
    ref_logits, ref_tokens = reference(engine, segs, query)
    # worker 0 is dead: the next address builds them
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, scatter=[mesh.dead, mesh.scatter.target],
                     workers=[0, 0])
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] * 2
    assert all(s.worker.startswith("scatter@") for s in ans.segments)

    # worker 0 dies mid-stream, worker 1 sends another segment's entry: built on the combine
    segs, query = prompt(6, (19, 44))
    ref_logits, ref_tokens = reference(engine, segs, query)
    dying = mesh.start_argv("dying", ["-c", DYING_SCATTER, str(mesh.tmp / "dying.port.json")]).wait()

    async def run():
        wrong = WrongScatter(engine)
        server = grpc.aio.server()
        scatter_grpc.add_ScatterServicer_to_server(wrong, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER,
                             scatter=[dying.target, f"127.0.0.1:{port}"], workers=[0, 0], store_entries=False)
            return await execute(mesh.combine.target, plan), wrong.calls
        finally:
            await server.stop(0)

    ans, wrong_calls = arun(run())
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [combine_pb.SOURCE_LOCAL] * 2 and wrong_calls == 2
    assert dying.proc.wait(timeout=10) == 17  # it really died mid-stream
    log = mesh.combine.log()
    assert '"reason": "forged"' in log and ('"reason": "short"' in log or '"reason": "unavailable"' in log)

    # the only scatter address is dead and so is segcache: built on the combine worker
    segs, query = prompt(11, (23, 17))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, scatter=[mesh.dead], segcache=mesh.dead)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [combine_pb.SOURCE_LOCAL] * 2


def test_combine_falls_back_when_segcache_fails(mesh, engine):
    # unreachable segcache: the misses go to scatter
    segs, query = prompt(7, (31, 28))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, segcache=mesh.dead)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] * 2
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
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, store_entries=False)
    ans = arun(execute(mesh.combine.target, plan))
    assert_matches(ans, ref_logits, ref_tokens, len(segs))
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] * 2
    assert arun(lookup_tiers(mesh.segcache.target, keys)) == [0, 0]  # dropped
    log = mesh.combine.log()
    assert '"reason": "corrupt"' in log and '"reason": "forged"' in log


def rewritten_header(entry_bytes: bytes, token_ids) -> bytes:
    """Entry bytes whose header claims `token_ids` (the payload unchanged): a poisoned entry.
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
        plan = make_plan(engine, mesh, [v], query, combine_pb.SOURCE_SEGCACHE)
        ans = arun(execute(mesh.combine.target, plan))
        assert_matches(ans, ref_logits, ref_tokens, 1)
        assert ans.sources() == [combine_pb.SOURCE_SCATTER], i
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


def test_bad_plans_are_rejected_and_combine_stays_up(mesh, engine):
    segs, query = prompt(9, (20, 20))

    def plan(**kw):
        p = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER)
        for name, value in kw.items():
            if isinstance(value, list):
                p.ClearField(name)
                getattr(p, name).extend(value)
            else:
                setattr(p, name, value)
        return p

    bad_seg = combine_pb.PlannedSegment(token_ids=[1, 2, 512], source=combine_pb.SOURCE_SCATTER)
    cases = {
        "no segments": (plan(segments=[]), grpc.StatusCode.INVALID_ARGUMENT),
        "empty query": (plan(query=[]), grpc.StatusCode.INVALID_ARGUMENT),
        "token >= vocab": (plan(segments=[bad_seg]), grpc.StatusCode.INVALID_ARGUMENT),
        "query token >= vocab": (plan(query=[3, 9999]), grpc.StatusCode.INVALID_ARGUMENT),
        "max_tokens 0": (plan(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        "unknown worker": (make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, workers=[0, 3]),
                           grpc.StatusCode.INVALID_ARGUMENT),
        "wrong key": (plan(segments=[combine_pb.PlannedSegment(key="ab" * 20, token_ids=segs[0])]),
                      grpc.StatusCode.INVALID_ARGUMENT),
        "fingerprint": (plan(model_fingerprint="0" * 32), grpc.StatusCode.FAILED_PRECONDITION),
        "dtype": (plan(dtype="bfloat16"), grpc.StatusCode.FAILED_PRECONDITION),
        "unknown mode": (plan(mode=9), grpc.StatusCode.INVALID_ARGUMENT),
        "seam 2^31": (plan(seam=2**31), grpc.StatusCode.INVALID_ARGUMENT),
        "denormal temperature": (plan(temperature=1e-45), grpc.StatusCode.INVALID_ARGUMENT),
    }

    async def run():
        got = {name: await status_of(execute(mesh.combine.target, p)) for name, (p, _) in cases.items()}
        # a cancelled request leaves nothing running behind
        big, _ = prompt(10, (2500, 2500))
        async with grpc.aio.insecure_channel(mesh.combine.target) as ch:
            stub = combine_grpc.CombineStub(ch)
            call = stub.Execute(make_plan(engine, mesh, big, query, combine_pb.SOURCE_LOCAL), timeout=60)
            await asyncio.sleep(0.3)
            call.cancel()
            for _ in range(400):
                info = await stub.Info(combine_pb.CombineInfoRequest(), timeout=10)
                if info.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
        # still serving, and still right
        status = await health(mesh.combine.target, "hypic.v1.Combine")
        ok = await execute(mesh.combine.target, plan())
        return got, info, status, ok

    got, info, status, ok = arun(run())
    assert got == {name: want for name, (_, want) in cases.items()}
    assert info.in_flight == 0 and info.model_fingerprint == engine.fingerprint and info.dtype == "float32"
    assert info.model_type == "qwen3_5_text"
    assert status == health_pb2.HealthCheckResponse.SERVING
    ref_logits, ref_tokens = reference(engine, segs, query)
    assert_matches(ok, ref_logits, ref_tokens, len(segs))
    assert mesh.combine.alive() and mesh.scatter.alive() and mesh.segcache.alive()
