"""The router plans hypic requests with the drift guard's seam (the segment keys follow it), past the
widest as full recompute (RequestState.served_mode says so), leaves requests that named another
mode alone, reports the guard in Info, and learns from shadow results through _on_shadow_result.
First the plans themselves (a RouterServicer in this process, no neighbour contacted: without
segcache or scatter every segment is built on combine), then the answers: the router served on
127.0.0.1 in front of a real combine process, each answer equal to the engine's at the guard's level."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from common.engine.fingerprint import segment_key
from hypic.processes import Service
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from services.router.config import RouterConfig
from services.router.drift_guard import MIN_RESULTS
from services.router.model import ModelInfo
from services.router.request import RequestState
from services.router.servicer import RouterServicer
from tests.support.peers import closed_port
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM, WIDER = 4, 8
DRIFTING = combine_pb.ShadowResult(kl=5.0, top1_agree=False, agreement=0.0, steps=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=7, **PIC_CONFIGS["qwen3_5_text"])


def router_config(model: Path, combine: str, **kw) -> RouterConfig:
    args = dict(model=model, combine_addresses=combine, seam=SEAM, drift_guard_seams=str(WIDER),
                drift_guard_hold_s=3600.0, max_prompt_tokens=4096, load_poll_s=0.0)
    args.update(kw)
    return RouterConfig(**args)


def request(rng: random.Random, mode: int = router_pb.PREFILL_MODE_HYPIC, **kw) -> router_pb.GenerateRequest:
    segments = [router_pb.Segment(token_ids=[rng.randrange(512) for _ in range(n)]) for n in (20, 17, 24)]
    return router_pb.GenerateRequest(segments=segments, query=router_pb.Segment(token_ids=[5, 6, 7]),
                                     max_tokens=2, mode=mode, **kw)


async def plan_of(servicer: RouterServicer, req_pb: router_pb.GenerateRequest) -> tuple[combine_pb.Plan, RequestState]:
    req = RequestState(rid="r", mode=req_pb.mode, t0=time.perf_counter(), deadline=time.monotonic() + 30)
    await servicer._prepare(req_pb, req)
    return await servicer._plan(req_pb, req), req


def drift(servicer: RouterServicer, seam: int) -> None:
    for _ in range(MIN_RESULTS):
        servicer._on_shadow_result(DRIFTING, seam)


def test_hypic_plans_follow_the_guard_other_modes_do_not(model, fresh_seed) -> None:
    rng = random.Random(fresh_seed)

    async def run() -> None:
        servicer = RouterServicer(router_config(model, f"127.0.0.1:{closed_port()}"), ModelInfo.load(model),
                                  ThreadPoolExecutor(1))
        fp = servicer.model.fingerprint
        try:
            for level, (seam, full) in enumerate([(SEAM, False), (WIDER, False), (SEAM, True)]):
                if level:
                    drift(servicer, servicer.guard.seams[level - 1])
                assert servicer.guard.current() == (0 if full else seam, full)
                plan, req = await plan_of(servicer, request(rng))
                want = router_pb.PREFILL_MODE_FULL if full else router_pb.PREFILL_MODE_HYPIC
                assert plan.mode == req.served_mode == want and req.mode == router_pb.PREFILL_MODE_HYPIC
                assert plan.seam == seam
                if full:  # combine prefills the tokens itself: no keys, nothing stored
                    assert not any(s.key for s in plan.segments) and not plan.store_entries
                else:
                    assert [s.key for s in plan.segments] == [
                        segment_key(fp, seam, "float32", list(s.token_ids)) for s in plan.segments]
                    assert req.seam == seam
                info = await servicer.Info(router_pb.InfoRequest(), None)
                assert info.drift.guard_enabled and info.drift.guard_full == full
                assert info.drift.guard_seam == (0 if full else seam)
                # Requests that asked for a mode of their own are planned as they asked.
                for mode, mode_seam in ((router_pb.PREFILL_MODE_FULL, SEAM), (router_pb.PREFILL_MODE_PREFIX, SEAM),
                                        (router_pb.PREFILL_MODE_ADDITIVE, 0)):
                    plan, req = await plan_of(servicer, request(rng, mode))
                    assert plan.mode == req.served_mode == mode and plan.seam == mode_seam
        finally:
            await servicer.close()

    asyncio.run(run())


def test_a_disabled_guard_plans_every_hypic_request_at_the_seam(model, fresh_seed) -> None:
    rng = random.Random(fresh_seed)

    async def run() -> None:
        cfg = router_config(model, f"127.0.0.1:{closed_port()}", drift_guard=False)
        servicer = RouterServicer(cfg, ModelInfo.load(model), ThreadPoolExecutor(1))
        try:
            for seam in (SEAM, WIDER, SEAM):
                drift(servicer, seam)
            plan, req = await plan_of(servicer, request(rng))
            assert plan.mode == req.served_mode == router_pb.PREFILL_MODE_HYPIC and plan.seam == SEAM
            info = await servicer.Info(router_pb.InfoRequest(), None)
            assert not info.drift.guard_enabled and info.drift.guard_seam == SEAM and not info.drift.guard_full
        finally:
            await servicer.close()

    asyncio.run(run())


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_answers_are_served_at_the_guards_level(model, tmp_path, fresh_seed) -> None:
    """Through a router on 127.0.0.1 and a real combine: at each guard level the answer's logits are
    the engine's for hypic at that seam, then for full recompute; the three differ on this model."""
    from common.engine.hybrid_engine import HybridEngine

    rng = random.Random(fresh_seed)
    req_pb = request(rng, return_logits=True)
    segs, query = [list(s.token_ids) for s in req_pb.segments], list(req_pb.query.token_ids)
    engine = HybridEngine.from_pretrained(model)
    refs = [engine.prefill_segments(segs, query, mode="hypic", seam=SEAM).logits,
            engine.prefill_segments(segs, query, mode="hypic", seam=WIDER).logits,
            engine.prefill(sum(segs, []) + query).logits]
    for i in range(3):
        for j in range(i):
            assert (refs[i] - refs[j]).abs().max() > 1e-3, (i, j)  # else this test tells nothing
    # fp32 entries: the answers are compared with the in-process engine's at 1e-4 (workers default to bf16)
    combine = Service(name="combine", kind="combine", args=["--model", str(model), "--threads", "1",
                                                            "--entry-format", "fp32"],
                      run_dir=tmp_path / "run", log_dir=tmp_path / "logs")
    combine.start()
    try:
        combine.wait_ready(time.monotonic() + 180)
        asyncio.run(_ask_at_each_level(router_config(model, combine.address), req_pb, refs))
    finally:
        combine.proc.terminate()
        combine.proc.wait(timeout=30)


async def _ask_at_each_level(cfg: RouterConfig, req_pb: router_pb.GenerateRequest, refs: list) -> None:
    servicer = RouterServicer(cfg, ModelInfo.load(cfg.model), ThreadPoolExecutor(1))
    server = grpc.aio.server()
    router_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_grpc.RouterStub(ch)
            for level, ref in enumerate(refs):
                if level:
                    drift(servicer, servicer.guard.seams[level - 1])
                events = [ev async for ev in stub.Generate(req_pb, timeout=120)]
                logits = torch.tensor(list(next(ev.token for ev in events if ev.HasField("token")).logits))
                assert (logits - ref).abs().max() < 1e-4, level
                info = await stub.Info(router_pb.InfoRequest(), timeout=10)
                assert info.drift.guard_full == (level == 2)
    finally:
        await server.stop(None)
        await servicer.close()
