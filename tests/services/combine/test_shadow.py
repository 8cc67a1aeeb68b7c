"""Combine.Shadow (issue 26) over a real combine process on the package's tiny model: its figures
are measure_drift's on the same inputs, it refuses while combine serves a request or runs another
shadow (RESOURCE_EXHAUSTED), and bad input is INVALID_ARGUMENT; a shadowed plan streams the
query's logits and each step's greedy pick."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import torch

from common.engine.drift import measure_drift
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from services.combine.shadow import MAX_SHADOW_STEPS
from tests.support.worker_mesh import (N_TOKENS, RPC_TIMEOUT_S, arun, execute, make_plan, prompt,
                                       reference)

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]

VOCAB = 512


async def shadow(target: str, req: combine_pb.ShadowRequest) -> combine_pb.ShadowResult:
    async with grpc.aio.insecure_channel(target) as ch:
        return await combine_grpc.CombineStub(ch).Shadow(req, timeout=RPC_TIMEOUT_S)


async def shadow_status(target: str, req: combine_pb.ShadowRequest) -> tuple[grpc.StatusCode, str]:
    try:
        await shadow(target, req)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def hypic_answer(engine, segs, query, steps: int = N_TOKENS):
    """What hypic served (its query logits and greedy tokens), from the in-process engine."""
    logits, tokens = reference(engine, segs, query)
    return logits, tokens[:steps]


def shadow_request(engine, prompt_ids, generated, argmax, logits, **kw) -> combine_pb.ShadowRequest:
    """A ShadowRequest; kw overrides its fields (hypic_logits as a list)."""
    args = dict(request_id="shadow-test", model_fingerprint=engine.fingerprint, prompt=prompt_ids,
                generated=generated, hypic_argmax=argmax, hypic_logits=logits.tolist())
    args.update(kw)
    return combine_pb.ShadowRequest(**args)


def test_shadow_figures_equal_measure_drift(mesh, engine):
    segs, query = prompt(21, (40, 33))
    logits, tokens = hypic_answer(engine, segs, query)
    flat = [t for s in segs for t in s] + query
    # greedy picks that differ from full recompute at some steps, so agreement is not trivially 1
    argmax = [t if i % 3 else (t + 1) % VOCAB for i, t in enumerate(tokens)]
    got = arun(shadow(mesh.combine.target, shadow_request(engine, flat, tokens, argmax, logits)))
    want = measure_drift(engine, flat, tokens, argmax, logits)
    assert got.steps == want.steps == len(tokens)
    assert got.top1_agree == want.top1_agree
    assert abs(got.kl - want.kl) < 1e-5, (got.kl, want.kl)
    assert abs(got.agreement - want.agreement) < 1e-9 and got.agreement < 1.0
    assert got.kl > 0 and got.compute_s > 0  # hypic w=8 on a random model is not full recompute
    # no generated tokens: agreement is the top-1 agreement at the query
    got0 = arun(shadow(mesh.combine.target, shadow_request(engine, flat, [], [], logits)))
    assert got0.steps == 1 and got0.agreement == float(got0.top1_agree)
    body = urllib.request.urlopen(f"http://127.0.0.1:{mesh.combine.info['metrics_port']}/metrics",
                                  timeout=10).read().decode()
    assert 'hypic_combine_shadows_total{outcome="computed"}' in body


def test_shadowed_plan_streams_logits_and_greedy_picks(mesh, engine):
    segs, query = prompt(22, (30, 30))
    ref_logits, _ = reference(engine, segs, query)
    plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER, return_logits=False,
                     shadow=True, temperature=5.0, seed=7)  # sampled tokens: argmax_id is still greedy
    ans = arun(execute(mesh.combine.target, plan))
    assert float((ans.logits - ref_logits).abs().max()) < 1e-4
    assert ans.tokens[0].argmax_id == int(ref_logits.argmax())
    assert any(t.argmax_id != t.token_id for t in ans.tokens), "temperature 5: some pick is not greedy"
    plain = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE,
                                                        return_logits=False)))
    assert not plain.tokens[0].logits and all(t.argmax_id == 0 for t in plain.tokens)


def test_shadow_refused_while_combine_is_busy(mesh, engine):
    segs, query = prompt(23, (30, 30))
    logits, tokens = hypic_answer(engine, segs, query)
    flat = [t for s in segs for t in s] + query
    req = shadow_request(engine, flat, tokens, tokens, logits)

    async def while_executing() -> tuple[grpc.StatusCode, str]:
        plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, max_tokens=3000,
                         stop_at_eos=False)
        async with grpc.aio.insecure_channel(mesh.combine.target) as ch:
            call = combine_grpc.CombineStub(ch).Execute(plan, timeout=RPC_TIMEOUT_S)
            async for ev in call:
                if ev.HasField("token"):  # in flight until its last token
                    break
            status = await shadow_status(mesh.combine.target, req)
            call.cancel()
            return status

    code, details = arun(while_executing())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "idle" in details

    # two shadows at once: one runs, the other is refused (a long prompt keeps the first running)
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, VOCAB, (3000,), generator=g).tolist()
    big = shadow_request(engine, long, tokens, tokens, logits)

    async def two() -> list[grpc.StatusCode]:
        return [c for c, _ in await asyncio.gather(shadow_status(mesh.combine.target, big),
                                                   shadow_status(mesh.combine.target, big))]
    assert sorted(arun(two()), key=lambda c: c.value) == [grpc.StatusCode.OK,
                                                          grpc.StatusCode.RESOURCE_EXHAUSTED]
    # idle again: served
    assert arun(shadow_status(mesh.combine.target, req))[0] == grpc.StatusCode.OK


def test_shadow_bad_input_is_invalid_argument(mesh, engine):
    segs, query = prompt(24, (20,))
    logits, tokens = hypic_answer(engine, segs, query)
    flat = segs[0] + query

    def req(**kw):
        args = dict(prompt_ids=flat, generated=tokens, argmax=tokens, logits=logits)
        if "prompt" in kw:
            args["prompt_ids"] = kw.pop("prompt")
        if "hypic_argmax" in kw:
            args["argmax"] = kw.pop("hypic_argmax")
        args.update(kw)
        return shadow_request(engine, **args)

    nan = logits.clone()
    nan[3] = float("nan")
    cases = {
        "model": req(model_fingerprint="another-model"),
        "empty": req(prompt=[]),
        "vocabulary": req(prompt=flat + [VOCAB]),
        "vocabulary ": req(generated=tokens[:-1] + [VOCAB + 5]),
        "greedy picks": req(hypic_argmax=tokens[:-1]),
        "at most": req(generated=[1] * (MAX_SHADOW_STEPS + 1), hypic_argmax=[1] * (MAX_SHADOW_STEPS + 1)),
        "logits": req(hypic_logits=logits.tolist()[:-1]),
        "finite": req(hypic_logits=nan.tolist()),
    }
    for expect, r in cases.items():
        code, details = arun(shadow_status(mesh.combine.target, r))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (expect, code, details)
        assert expect.strip() in details, (expect, details)
    assert mesh.combine.alive()
