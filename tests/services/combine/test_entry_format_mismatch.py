"""A combine and an entry of different storage formats (--entry-format), end to end on real
processes (tests/support/worker_mesh.py): never a wrong answer, counted, and no rebuild loop.

- fp32 combine, bf16 scatter worker and bf16 entries in segcache: the lossy entries are refused
  (the answer is the fp32 one, far nearer it than what bf16 entries give), dropped from segcache, the segment built on the combine once, not on the next
  scatter worker, and its fp32 entry stored: the next request is a segcache hit.
- bf16 combine, fp32 scatter worker and fp32 entries: rounded to bf16 on arrival, no rebuild (the
  answer is exactly the bf16 one)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from common.engine.pic import SegmentEntry
from common.engine.pic.seal import open_sealed, seal
from common.mesh.segcache_client import SegcacheClient
from protos.hypic.v1 import combine_pb2 as combine_pb
from tests.support.worker_mesh import (N_TOKENS, SEAM, SECRET, arun, assert_matches, execute, make_plan,
                                       prompt, reference)

pytestmark = [pytest.mark.timeout(400), pytest.mark.processes]


def _worker(mesh, name: str, module: str, fmt: str, *extra: str):
    s = mesh.start(name, module, "--model", str(mesh.model), "--threads", "1",
                   "--segcache-address", mesh.segcache.target, "--entry-key-file", str(mesh.tmp / "entry.key"),
                   "--entry-format", fmt, *extra)
    return s


@pytest.fixture(scope="module")
def other_format_workers(mesh):
    """A bf16 scatter and a bf16 combine beside the package's fp32 ones (started together)."""
    scatter = _worker(mesh, "scatter-bf16", "services.scatter", "bf16")
    combine = _worker(mesh, "combine-bf16", "services.combine", "bf16", "--metrics-port", "0")
    scatter.wait()
    combine.wait()
    yield scatter, combine
    assert {s.name: s.terminate() for s in (scatter, combine)} == {"scatter-bf16": 0, "combine-bf16": 0}


def reference_with(engine, fmt: str, segs, query):
    """Logits and tokens of a hypic prefill from entries stored in `fmt`."""
    entries = [engine.build_entry(s, SEAM).with_format(fmt) for s in segs]
    out = engine.prefill_segments(segs, query, entries=entries, seam=SEAM)
    return out.logits, engine.generate(out, max_new_tokens=N_TOKENS)


def assert_closer(ans, want_logits, other_logits) -> None:
    """The answer's logits are those of `want` (the format the combine composes), not `other`'s:
    far nearer the one than the other (the formats differ by less than the match tolerance on
    this tiny model, so the tolerance alone does not tell them apart)."""
    near, far = (float((ans.logits - x).abs().max()) for x in (want_logits, other_logits))
    assert near * 8 < far, (near, far)


def metric(service, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.info['metrics_port']}/metrics", timeout=10).read().decode()
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want + " "))


def builds(service) -> int:
    return sum(1 for line in service.log().splitlines()
               if line.startswith("{") and json.loads(line).get("event") == "built")


async def stored_formats(target: str, keys) -> list[str | None]:
    async with SegcacheClient(target) as sc:
        out = []
        for k in keys:
            data = await sc.get(k)
            out.append(None if data is None else SegmentEntry.from_bytes(bytes(open_sealed(data, k, SECRET))).format)
        return out


async def replace_in_segcache(target: str, keys, datas) -> None:
    async with SegcacheClient(target) as sc:
        await sc.delete(list(keys))
        for k, d in zip(keys, datas):
            await sc.put(k, d)


def test_fp32_combine_never_composes_bf16_entries_and_stops_rebuilding(mesh, engine, other_format_workers):
    bf16_scatter, _ = other_format_workers
    segs, query = prompt(31, (30, 26))
    ref_logits, ref_tokens = reference(engine, segs, query)
    lossy_logits, _ = reference_with(engine, "bf16", segs, query)
    assert float((lossy_logits - ref_logits).abs().max()) > 0  # bf16 entries give another answer
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER,
                     scatter=[bf16_scatter.target, mesh.scatter.target])
    keys = [s.key for s in plan.segments]
    wrong0 = metric(mesh.combine, "hypic_combine_fallbacks_total", what="scatter", reason="format")
    fp32_builds0 = builds(mesh.scatter)

    ans = arun(execute(mesh.combine.target, plan))  # 1: the bf16 scatter's entries are refused
    assert_matches(ans, ref_logits, ref_tokens, 2)
    assert_closer(ans, ref_logits, lossy_logits)
    assert ans.sources() == [combine_pb.SOURCE_LOCAL] * 2  # not the next scatter worker: built here
    assert metric(mesh.combine, "hypic_combine_fallbacks_total", what="scatter", reason="format") == wrong0 + 2
    assert builds(bf16_scatter) == 2 and builds(mesh.scatter) == fp32_builds0

    # 2: segcache holds bf16 entries (sealed, the right segment: only the format is wrong)
    bf16 = [seal(engine.build_entry(s, SEAM).with_format("bf16").to_bytes(), SECRET) for s in segs]
    arun(replace_in_segcache(mesh.segcache.target, keys, bf16))
    assert arun(stored_formats(mesh.segcache.target, keys)) == ["bf16", "bf16"]
    dropped0 = metric(mesh.combine, "hypic_combine_entries_dropped_total", reason="format")
    plan2 = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, scatter=[bf16_scatter.target])
    ans = arun(execute(mesh.combine.target, plan2))
    assert_matches(ans, ref_logits, ref_tokens, 2)
    assert_closer(ans, ref_logits, lossy_logits)
    assert ans.sources() == [combine_pb.SOURCE_LOCAL] * 2
    assert metric(mesh.combine, "hypic_combine_entries_dropped_total", reason="format") == dropped0 + 2
    assert builds(bf16_scatter) == 2  # a bf16 entry in segcache does not send the segment to a scatter

    # 3..4: the combine's own fp32 entries took the keys: hits from now on, no more builds
    for _ in range(2):
        for _ in range(100):  # the stores run after the answer
            if arun(stored_formats(mesh.segcache.target, keys)) == ["fp32", "fp32"]:
                break
            time.sleep(0.05)
        assert arun(stored_formats(mesh.segcache.target, keys)) == ["fp32", "fp32"]
        ans = arun(execute(mesh.combine.target, plan2))
        assert_matches(ans, ref_logits, ref_tokens, 2)
        assert_closer(ans, ref_logits, lossy_logits)
        assert ans.sources() == [combine_pb.SOURCE_SEGCACHE] * 2
    assert builds(bf16_scatter) == 2


def test_bf16_combine_rounds_fp32_entries_instead_of_rebuilding(mesh, engine, other_format_workers):
    _, bf16_combine = other_format_workers
    segs, query = prompt(32, (27, 33))
    ref_logits, ref_tokens = reference_with(engine, "bf16", segs, query)
    exact_logits, _ = reference(engine, segs, query)
    assert float((exact_logits - ref_logits).abs().max()) > 0
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, segcache=mesh.segcache.target)
    keys = [s.key for s in plan.segments]
    fp32_builds0 = builds(mesh.scatter)

    ans = arun(execute(bf16_combine.target, plan))  # fp32 entries from the fp32 scatter
    assert_matches(ans, ref_logits, ref_tokens, 2)
    assert_closer(ans, ref_logits, exact_logits)
    assert ans.sources() == [combine_pb.SOURCE_SCATTER] * 2
    assert builds(mesh.scatter) == fp32_builds0 + 2
    for _ in range(100):  # the scatter's stores
        if None not in arun(stored_formats(mesh.segcache.target, keys)):
            break
        time.sleep(0.05)
    assert arun(stored_formats(mesh.segcache.target, keys)) == ["fp32", "fp32"]
    plan2 = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, segcache=mesh.segcache.target)
    ans = arun(execute(bf16_combine.target, plan2))  # fp32 entries from segcache: kept there
    assert_matches(ans, ref_logits, ref_tokens, 2)
    assert_closer(ans, ref_logits, exact_logits)
    assert ans.sources() == [combine_pb.SOURCE_SEGCACHE] * 2
    assert metric(bf16_combine, "hypic_combine_entries_converted_total", stored="fp32", expected="bf16") == 4
    assert arun(stored_formats(mesh.segcache.target, keys)) == ["fp32", "fp32"]
    assert builds(mesh.scatter) == fp32_builds0 + 2
