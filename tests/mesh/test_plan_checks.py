"""common.mesh.checks.check_plan / check_build: the one place a worker checks a request before
any compute. Random valid plans come back with the keys segment_key gives their tokens; each
malformed field is refused with its own gRPC status."""
from __future__ import annotations

import random

import grpc
import pytest

from common.engine import modes
from common.engine.fingerprint import segment_key
from common.mesh.abort import Abort
from common.mesh.checks import CheckedPlan, WorkerModel, check_build, check_plan
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import scatter_pb2 as scatter_pb

WORKER = WorkerModel(fingerprint="f" * 64, dtype="float32", vocab_size=100)
LIMITS = dict(max_new_tokens=16, max_prompt_tokens=64)


def random_plan(rng: random.Random, mode: str = "hypic") -> combine_pb.Plan:
    seam = rng.randint(0, 4)
    segs = [[rng.randrange(WORKER.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 4))]
    key_seam = modes.seam_for(mode, seam)
    return combine_pb.Plan(
        mode=modes.to_wire(mode), seam=seam, model_fingerprint=WORKER.fingerprint, dtype=WORKER.dtype,
        query=[rng.randrange(WORKER.vocab_size) for _ in range(rng.randint(1, 5))], max_tokens=4,
        scatter_addresses=["a:1"],
        segments=[combine_pb.PlannedSegment(token_ids=ids, source=combine_pb.SOURCE_SCATTER, worker=0,
                                            key=segment_key(WORKER.fingerprint, key_seam, WORKER.dtype, ids))
                  for ids in segs])


@pytest.mark.parametrize("mode", ["hypic", "additive", "full"])
def test_valid_plans_come_back_with_their_keys(mode: str) -> None:
    rng = random.Random(mode)
    for _ in range(20):
        plan = random_plan(rng, mode)
        checked = check_plan(plan, WORKER, **LIMITS)
        assert isinstance(checked, CheckedPlan) and checked.mode == mode
        assert checked.seam == modes.seam_for(mode, plan.seam)
        assert checked.segments == [list(s.token_ids) for s in plan.segments]
        assert checked.query == list(plan.query)
        # Every mode gets the content keys (modes without entries never read them).
        assert checked.keys == [segment_key(WORKER.fingerprint, checked.seam, WORKER.dtype, ids)
                                for ids in checked.segments]


def _broken(field: str) -> combine_pb.Plan:
    plan = random_plan(random.Random(field))
    if field == "mode":
        plan.mode = 99
    elif field == "token":
        plan.segments[0].token_ids[0] = WORKER.vocab_size
    elif field == "query":
        del plan.query[:]
    elif field == "key":
        plan.segments[0].key = "0" * 64
    elif field == "worker":
        plan.segments[0].worker = 1
    elif field == "max_tokens":
        plan.max_tokens = LIMITS["max_new_tokens"] + 1
    elif field == "prompt":
        plan.query.extend([1] * LIMITS["max_prompt_tokens"])
    elif field == "temperature":
        plan.temperature = float("nan")
    elif field == "fingerprint":
        plan.model_fingerprint = "e" * 64
    elif field == "dtype":
        plan.dtype = "bfloat16"
    return plan


@pytest.mark.parametrize("field, code", [
    ("mode", grpc.StatusCode.INVALID_ARGUMENT), ("token", grpc.StatusCode.INVALID_ARGUMENT),
    ("query", grpc.StatusCode.INVALID_ARGUMENT), ("key", grpc.StatusCode.INVALID_ARGUMENT),
    ("worker", grpc.StatusCode.INVALID_ARGUMENT), ("max_tokens", grpc.StatusCode.INVALID_ARGUMENT),
    ("prompt", grpc.StatusCode.INVALID_ARGUMENT), ("temperature", grpc.StatusCode.INVALID_ARGUMENT),
    ("fingerprint", grpc.StatusCode.FAILED_PRECONDITION), ("dtype", grpc.StatusCode.FAILED_PRECONDITION)])
def test_each_malformed_field_is_refused(field: str, code: grpc.StatusCode) -> None:
    with pytest.raises(Abort) as e:
        check_plan(_broken(field), WORKER, **LIMITS)
    assert e.value.code == code


def test_check_build_needs_the_key_of_its_tokens() -> None:
    ids = [1, 2, 3]
    key = segment_key(WORKER.fingerprint, 2, WORKER.dtype, ids)
    req = scatter_pb.BuildRequest(key=key, token_ids=ids, seam=2, model_fingerprint=WORKER.fingerprint,
                                  dtype=WORKER.dtype)
    assert check_build(req, WORKER, max_segment_tokens=8) == ids
    for bad in (dict(key=""), dict(token_ids=[1, 2, 100]), dict(token_ids=list(range(9)))):
        broken = scatter_pb.BuildRequest()
        broken.CopyFrom(req)
        for name, value in bad.items():
            broken.ClearField(name)
            if value:
                getattr(broken, name).extend(value) if isinstance(value, list) else setattr(broken, name, value)
        with pytest.raises(Abort) as e:
            check_build(broken, WORKER, max_segment_tokens=8)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
