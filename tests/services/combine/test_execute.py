"""The combine worker as a process (tests/support/worker_mesh.py): cold and warm plans answer like
the in-process engine in every mode, warm plans compose layer-major, plans with misses compose runs
of entries as they arrive, and --compose-order is read and checked."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import grpc
import pytest

from common.engine.pic.seal import seal
from common.mesh.nixl_util import load_nixl
from common.mesh.segcache_client import checksum
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from tests.support.worker_mesh import (N_TOKENS, SEAM, SECRET, TOL, arun, assert_matches,
                                       compositions, execute, executed_line, make_plan, prompt,
                                       reference)

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]


def test_combine_cold_then_warm_matches_in_process(mesh, engine):
    segs, query = prompt(3, (40, 57, 33))
    ref_logits, ref_tokens = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER)
    cold = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-cold-mesh")]))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    assert cold.sources() == [combine_pb.SOURCE_SCATTER] * 3
    assert all(s.worker.startswith("scatter@") and s.build_s > 0 for s in cold.segments)
    t = cold.timings[0]
    assert t.misses == 3 and t.hits == 0 and t.prompt_tokens == 135 and t.ttft_s > 0
    # arrived runs: each pass layer-major, its seams inside compose_s; the query folded into the last
    assert t.compose_s > 0 and t.seams_s == 0 and t.query_prefill_s == 0 and t.scatter_s > 0
    # the request id travelled combine -> scatter (metadata and BuildRequest)
    assert '"request_id": "rid-cold-mesh"' in mesh.scatter.log()

    warm_plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE)  # the live member
    warm = arun(execute(mesh.combine.target, warm_plan))
    assert_matches(warm, ref_logits, ref_tokens, len(segs))
    assert warm.sources() == [combine_pb.SOURCE_SEGCACHE] * 3
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
    before, answers = engine_counts(mesh), {}
    for mode, name in ((router_pb.PREFILL_MODE_FULL, "full"), (router_pb.PREFILL_MODE_PREFIX, "prefix"),
                       (router_pb.PREFILL_MODE_ADDITIVE, "additive")):
        ref_logits, ref_tokens = reference(engine, segs, query, mode=name)
        ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER,
                                                          mode=mode)))
        answers[name] = ans
        # full and prefix recompute on the combine worker: no segment events; what they
        # recomputed in a Timings before the first token (the router reports it with that token)
        baseline = name != "additive"
        assert_matches(ans, ref_logits, ref_tokens, 0 if baseline else len(segs), 2 if baseline else 1)
        if baseline:
            assert ans.kinds[0] == "timings" and ans.kinds[1] == "token", ans.kinds
            assert ans.timings[0].recomputed == len(segs) and ans.timings[-1].recomputed == len(segs)
        else:
            assert ans.timings[0].recomputed == 0
    # prefix again: this worker's prefix cache now holds every boundary of the prompt
    ref_logits, ref_tokens = reference(engine, segs, query, mode="prefix")
    again = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER,
                                                        mode=router_pb.PREFILL_MODE_PREFIX)))
    assert_matches(again, ref_logits, ref_tokens, 0, 2)
    assert again.timings[0].recomputed == 0
    longer = segs + [[7, 8, 9]]
    ref_logits, ref_tokens = reference(engine, longer, query, mode="prefix")
    more = arun(execute(mesh.combine.target, make_plan(engine, mesh, longer, query, combine_pb.SOURCE_SCATTER,
                                                       mode=router_pb.PREFILL_MODE_PREFIX)))
    assert_matches(more, ref_logits, ref_tokens, 0, 2)
    assert more.timings[0].recomputed == 1  # only the segment past the cached prefix
    # the engine thread's own time per mode and phase, and the wait for it apart (issue 27)
    after = engine_counts(mesh)
    calls = {key: n - before.get(key, 0.0) for key, n in after.items()}
    assert calls[("full", "prefill")] == 1 and calls[("prefix", "prefill")] == 3, calls
    assert calls[("full", "decode_token")] == len(answers["full"].token_ids) - 1, calls
    assert calls[("additive", "compose")] >= 1 and calls[("additive", "query")] == 1, calls
    # sampling: the same tokens as engine.generate with the same seed, temperature and top_k
    out = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    want = engine.generate(out, max_new_tokens=N_TOKENS, temperature=0.8, top_k=20, seed=1234)
    ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE,
                                                      temperature=0.8, top_k=20, seed=1234)))
    assert ans.token_ids == want


def engine_counts(mesh) -> dict[tuple[str, str], float]:
    """(mode, phase) -> calls observed by hypic_combine_engine_seconds; checks that every mode
    seen there also has its engine-thread wait observed."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{mesh.combine.info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    counts = {}
    for line in body.splitlines():
        if line.startswith("hypic_combine_engine_seconds_count{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            counts[(labels["mode"].strip('"'), labels["phase"].strip('"'))] = float(line.split()[-1])
    for mode in {mode for mode, _ in counts}:
        assert f'hypic_combine_engine_wait_seconds_count{{mode="{mode}"}}' in body, mode
    return counts


# ---- composition order --------------------------------------------------------------------------
def test_combine_warm_plan_composes_layer_major(mesh, engine, model_dir):
    # many short segments (the agent shape), one shorter than the seam
    segs, query = prompt(12, (14, 6, 23, 11, 17, 9))
    n = len(segs)
    ref_logits, ref_tokens = reference(engine, segs, query)
    # the same model, always segment-major; it loads while the cold request runs
    seg_worker = mesh.start("combine-segment", "services.combine", "--model", str(model_dir),
                            "--threads", "1", "--compose-order", "segment",
                            "--segcache-address", mesh.segcache.target,  # the member plans name
                            "--entry-key-file", str(mesh.tmp / "entry.key"))
    layer0, mixed0, segment0 = compositions(mesh.combine)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER)))
    assert_matches(cold, ref_logits, ref_tokens, n)  # and every entry is now in segcache

    warm_plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE)
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
    ans = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs2, query, combine_pb.SOURCE_SEGCACHE)))
    assert_matches(ans, ref_logits, ref_tokens, n + 1)
    assert ans.sources() == [combine_pb.SOURCE_SEGCACHE] * 3 + [combine_pb.SOURCE_SCATTER] + [combine_pb.SOURCE_SEGCACHE] * 3
    t = ans.timings[0]
    assert t.hits == n and t.misses == 1 and t.seams_s == 0 and t.scatter_s > 0
    assert compositions(mesh.combine) == (layer0 + 2, mixed0, segment0 + 1)


def test_combine_plan_with_misses_composes_as_they_arrive(mesh, engine):
    segs, query = prompt(14, (27, 12, 33))
    layer0, mixed0, segment0 = compositions(mesh.combine)
    # all misses (built by scatter, and stored)
    ref_logits, ref_tokens = reference(engine, segs, query)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER),
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
    plan = make_plan(engine, mesh, segs2, query, combine_pb.SOURCE_SEGCACHE)
    plan.segments[0].source = combine_pb.SOURCE_SCATTER
    ref_logits, ref_tokens = reference(engine, segs2, query)
    ans = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-miss-first")]))
    assert_matches(ans, ref_logits, ref_tokens, len(segs2))
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] + [combine_pb.SOURCE_SEGCACHE] * 3
    assert ans.timings[0].hits == 3
    executed = executed_line(mesh.combine, "rid-miss-first")
    assert executed["compose_order"] == "segment" and sum(executed["compose_runs"]) == len(segs2)
    assert compositions(mesh.combine) == (layer0, mixed0, segment0 + 2)
    # hits, a planned miss, a hit: the leading two hits in one layer-major pass, then the miss
    # and the last hit as they arrive
    segs3 = segs[:2] + [fresh1] + segs[2:]
    plan = make_plan(engine, mesh, segs3, query, combine_pb.SOURCE_SEGCACHE)
    plan.segments[2].source = combine_pb.SOURCE_SCATTER
    ref_logits, ref_tokens = reference(engine, segs3, query)
    ans = arun(execute(mesh.combine.target, plan, metadata=[("x-request-id", "rid-mixed")]))
    assert_matches(ans, ref_logits, ref_tokens, len(segs3))
    assert ans.sources() == [combine_pb.SOURCE_SEGCACHE] * 2 + [combine_pb.SOURCE_SCATTER, combine_pb.SOURCE_SEGCACHE]
    assert ans.timings[0].hits == 3
    executed = executed_line(mesh.combine, "rid-mixed")
    assert executed["compose_order"] == "mixed" and executed["compose_runs"][0] == 2
    assert sum(executed["compose_runs"]) == len(segs3)
    assert compositions(mesh.combine) == (layer0, mixed0 + 1, segment0 + 2)


def test_combine_additive_all_hits_stays_segment_major(mesh, engine):
    segs, query = prompt(16, (24, 13, 30))
    ref_logits, ref_tokens = reference(engine, segs, query, mode="additive")
    layer0, mixed0, segment0 = compositions(mesh.combine)
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER,
                                                       mode=router_pb.PREFILL_MODE_ADDITIVE)))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    # the seam-0 entries are in segcache now; layer-major would add them with T, not additively
    warm = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE,
                                                       mode=router_pb.PREFILL_MODE_ADDITIVE),
                        metadata=[("x-request-id", "rid-warm-additive")]))
    assert_matches(warm, ref_logits, ref_tokens, len(segs))
    assert warm.timings[0].hits == len(segs)
    assert compositions(mesh.combine) == (layer0, mixed0, segment0 + 2)
    executed = executed_line(mesh.combine, "rid-warm-additive")
    assert executed["compose_order"] == "segment" and executed["mode"] == "additive"


class GatedScatter(scatter_grpc.ScatterServicer):
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
        header = scatter_pb.BuildHeader(key=request.key, size=len(data), worker="gated", checksum=checksum(data))
        yield scatter_pb.BuildResponse(header=header, data=data)


async def execute_gated(engine, mesh, target, segs, query, delay_s, rid):
    server = grpc.aio.server()
    scatter_grpc.add_ScatterServicer_to_server(GatedScatter(engine, segs, delay_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, scatter=[f"127.0.0.1:{port}"],
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
                            "--segcache-address", mesh.segcache.target,  # the member plans name
                            "--entry-key-file", str(mesh.tmp / "entry.key"))
    lengths = [rng.choice([3, 7, 9, 13]) if rng.random() < 0.3 else rng.randint(15, 70) for _ in range(7)]
    segs, query = prompt(fresh_seed % 100_000 + 1000, lengths)
    ref_logits, ref_tokens = reference(engine, segs, query)
    n = len(segs)
    # segment 0 last, well after the others: when it arrives everything is in hand, one run of n
    delays = [1.2] + [rng.uniform(0.0, 0.4) for _ in range(n - 1)]
    ans = arun(execute_gated(engine, mesh, mesh.combine.target, segs, query, delays, f"rid-runs-{fresh_seed}"))
    assert_matches(ans, ref_logits, ref_tokens, n)
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] * n and ans.timings[0].seams_s == 0
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
