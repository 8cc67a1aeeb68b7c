"""Builds nobody waits for stop, even while running: abandoned work must not keep a worker busy.

Unit: `build_entry(..., should_stop=...)` stops before the layer where should_stop first answers
True (BuildCancelled, no entry), and is bit-identical to the plain build when it never fires.
End to end: real processes (hypic.launcher.Mesh: router → combine → one scatter) on a tiny model
deep enough that each segment's build takes a second or more; requests abandoned after 0.3 s
(their deadline) stop the scatter's running build between layers, the scatter stays healthy and
idle long before the abandoned work could have finished, and the same segments asked again are
built fresh and answered like the in-process engine.
"""
from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

import hypic
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import BuildCancelled
from hypic.launcher import Mesh
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from tests.support.tiny import PIC_CONFIGS, save_tiny
from tests.support.worker_mesh import FP32_ENTRIES_ENV

SEAM = 8
DEEP = dict(PIC_CONFIGS["qwen3_5_text"], num_hidden_layers=12,
            layer_types=["linear_attention", "full_attention"] * 6)
SEGMENT_TOKENS = 5000  # ~1-2 s per build of DEEP on one CPU thread (the router cuts nothing: --cut-tokens 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("deep"), seed=11, **DEEP)


@pytest.fixture(scope="module")
def engine(model) -> HybridEngine:
    return HybridEngine.from_pretrained(model)


def doc(g: random.Random, n: int) -> list[int]:
    return [g.randrange(1, 500) for _ in range(n)]


# ---- unit ------------------------------------------------------------------------------------------
def _count_layer_runs(engine) -> tuple[list[int], list]:
    ran: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: ran.append(i))
             for i, layer in enumerate(engine.model.layers)]
    return ran, hooks


@pytest.mark.parametrize("k", [0, 1, 5, 11, 12])
def test_should_stop_stops_the_build_at_layer_k(engine, fresh_seed, k):
    """should_stop turns True once layer k is reached: layers 0..k-1 ran, none after, no entry.
    k = 12 (the layer count): the forward ran whole; the check before the entry is put together
    still stops it."""
    ids = doc(random.Random(fresh_seed), 300)
    asked: list[int] = []
    ran, hooks = _count_layer_runs(engine)

    def should_stop() -> bool:
        asked.append(len(ran))
        return len(ran) >= k
    try:
        with pytest.raises(BuildCancelled) as e:
            engine.build_entry(ids, SEAM, should_stop=should_stop)
    finally:
        for h in hooks:
            h.remove()
    assert e.value.layer == k and e.value.layers == 12 and e.value.tokens == len(ids)
    assert ran == list(range(k))  # stopped there: no later layer ran
    assert asked == list(range(k + 1))  # asked once per layer boundary until it fired


def test_a_check_that_never_fires_changes_no_bit(engine, fresh_seed):
    ids = doc(random.Random(fresh_seed), 257)
    plain = engine.build_entry(ids, SEAM).to_bytes()
    checked = engine.build_entry(ids, SEAM, should_stop=lambda: False).to_bytes()
    assert plain == checked


# ---- end to end ------------------------------------------------------------------------------------
def metric(port: int, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in body.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def scatter_events(mesh, event: str) -> list[dict]:
    out = []
    for line in mesh.log("scatter0").splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if d.get("event") == event:
                out.append(d)
    return out


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_abandoned_requests_stop_running_builds(model, engine, tmp_path, fresh_seed):
    g = random.Random(fresh_seed)
    with Mesh(model, tmp_path, n_scatter=1, threads=1, seam=SEAM, start_timeout_s=180, env=FP32_ENTRIES_ENV,
              extra_args={"router": ["--max-prompt-tokens", "40000", "--cut-tokens", "0"],
                          "scatter": ["--metrics-port", "0"]}) as mesh:
        port = mesh["scatter0"].info["metrics_port"]
        with hypic.Client(mesh.router_address, timeout=120) as c:
            c.generate(segments=[doc(g, 40)], query=[3, 4], max_tokens=1, stream=False)  # warm channels
            done0 = metric(port, "hypic_scatter_build_work_tokens_total", part="done")
            requests = [([doc(g, SEGMENT_TOKENS) for _ in range(3)], [5, 6, 7]) for _ in range(2)]
            total = sum(len(s) for segs, _ in requests for s in segs)
            t0 = time.monotonic()
            for segs, query in requests:
                with pytest.raises(hypic.HypicError):
                    c.generate(segments=segs, query=query, max_tokens=4, stream=False, timeout=0.3)
            abandoned_s = time.monotonic() - t0
            idle_s = wait_idle(mesh)
            done = metric(port, "hypic_scatter_build_work_tokens_total", part="done") - done0
            cancelled = scatter_events(mesh, "build cancelled")
            built_long = [d for d in scatter_events(mesh, "built") if d["tokens"] >= SEGMENT_TOKENS]
            print(f"\n[cancel] {total} tokens of builds abandoned within {abandoned_s:.2f} s; "
                  f"scatter idle {idle_s:.2f} s later; {done:.0f} tokens prefilled; "
                  f"{len(cancelled)} running builds stopped at layers "
                  f"{[d['layer'] for d in cancelled]} of 12")
            assert cancelled, "no running build was stopped"
            assert all(d["layer"] < d["layers"] for d in cancelled)
            assert not built_long, built_long
            assert done < 0.25 * total, (done, total)
            assert mesh.healthy("scatter0") and not mesh.dead()

            # the same segments again: built fresh (nothing was stored), answered like in-process
            segs, query = requests[0]
            ref = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
            ref_tokens = engine.generate(ref, max_new_tokens=4)
            res = c.generate(segments=segs, query=query, max_tokens=4, stream=False, return_logits=True)
            assert res.timings.misses == len(segs) and res.timings.hits == 0
            assert res.tokens == ref_tokens
            assert (torch.tensor(res.logits) - ref.logits).abs().max() < 1e-4


def log_events(mesh, name: str, event: str) -> list[dict]:
    return [d for d in (json.loads(x) for x in mesh.log(name).splitlines() if x.startswith("{"))
            if d.get("event") == event]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_an_abandoned_request_stops_combines_local_build(model, engine, tmp_path, fresh_seed):
    """No scatter: combine builds the misses itself, on its engine thread; the running build
    stops between layers when the request goes away, and the next request is served."""
    g = random.Random(fresh_seed)
    with Mesh(model, tmp_path, n_scatter=0, threads=1, seam=SEAM, start_timeout_s=180, env=FP32_ENTRIES_ENV,
              extra_args={"router": ["--max-prompt-tokens", "40000", "--cut-tokens", "0"]}) as mesh:
        with hypic.Client(mesh.router_address, timeout=120) as c:
            c.generate(segments=[doc(g, 40)], query=[3, 4], max_tokens=1, stream=False)  # warm
            segs, query = [doc(g, SEGMENT_TOKENS) for _ in range(2)], [5, 6, 7]
            with pytest.raises(hypic.HypicError):
                c.generate(segments=segs, query=query, max_tokens=4, stream=False, timeout=0.3)
            deadline = time.monotonic() + 30
            while not (stopped := log_events(mesh, "combine0", "local build stopped")):
                assert time.monotonic() < deadline, "the running local build was not stopped"
                time.sleep(0.05)
            assert all(d["layer"] < d["layers"] and d["tokens"] == SEGMENT_TOKENS for d in stopped), stopped
            small = [doc(g, 30), doc(g, 20)]
            ref = engine.prefill_segments(small, query, mode="hypic", seam=SEAM)
            res = c.generate(segments=small, query=query, max_tokens=4, stream=False)
            assert res.tokens == engine.generate(ref, max_new_tokens=4)
            assert mesh.healthy() and not mesh.dead()


def wait_idle(mesh, timeout_s: float = 60.0) -> float:
    """Seconds until the scatter reports no build running or queued (Scatter.Load)."""
    t0 = time.monotonic()
    with grpc.insecure_channel(mesh["scatter0"].address) as ch:
        stub = scatter_grpc.ScatterStub(ch)
        while time.monotonic() - t0 < timeout_s:
            if stub.Load(scatter_pb.LoadRequest(), timeout=10).in_flight == 0:
                return time.monotonic() - t0
            time.sleep(0.05)
    raise AssertionError("scatter still busy")
