"""The checks a model worker (scatter, combine) makes of a request before any compute: its
limits, its mode, its token ids against the vocabulary, that it was planned for this worker's
model and dtype, and that its segment keys are the content addresses of its tokens. One home, so
both workers refuse the same requests with the same status:

    plan = check_plan(request_plan, worker, max_new_tokens=..., max_prompt_tokens=...)  # combine
    ids = check_build(build_request, worker, max_segment_tokens=...)                    # scatter

`worker` (a WorkerModel) is what the engine says of itself: fingerprint, dtype and vocabulary
size; the mesh takes them as values and never imports the engine's model code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import grpc

from common.engine.modes import from_wire, seam_for, uses_entries
from common.engine.fingerprint import segment_key
from common.mesh.abort import Abort
from protos.hypic.v1 import combine_pb2 as combine_pb


# A seam is a few tokens; the bound keeps it far inside segment_key's signed 32-bit field.
MAX_SEAM = 1 << 20
# Below this, logits / temperature overflows float32 to inf and sampling produces NaN; the
# distribution is a plain argmax long before it, so nothing is lost.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3


def check_seam(seam: int) -> int:
    """INVALID_ARGUMENT unless 0 <= seam <= MAX_SEAM."""
    if not 0 <= int(seam) <= MAX_SEAM:
        raise Abort.invalid(f"seam {seam} out of range [0, {MAX_SEAM}]")
    return int(seam)


def check_temperature(temperature: float) -> float:
    """INVALID_ARGUMENT unless temperature is 0 (greedy) or finite in [MIN, MAX]_TEMPERATURE."""
    t = float(temperature)
    if not (t == 0.0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
        raise Abort.invalid(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    return t


def check_model(fingerprint: str, dtype: str, *, worker_fingerprint: str, worker_dtype: str) -> None:
    """FAILED_PRECONDITION unless the request's model and dtype are this worker's."""
    if fingerprint != worker_fingerprint:
        raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                    f"model fingerprint {fingerprint[:12]!r} is not this worker's ({worker_fingerprint[:12]})")
    if dtype != worker_dtype:
        raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"dtype {dtype!r} is not this worker's ({worker_dtype})")


def expected_key(key: str, token_ids: Sequence[int], *, fingerprint: str, seam: int, dtype: str,
                 what: str = "key", required: bool = False) -> str:
    """segment_key(...) of `token_ids`; INVALID_ARGUMENT when `key` differs from it (an empty key
    is accepted unless `required`)."""
    want = segment_key(fingerprint, check_seam(seam), dtype, token_ids)
    if (key or required) and key != want:
        raise Abort.invalid(f"{what} {key[:16]!r} is not segment_key(...) of its tokens with seam {seam} "
                            f"({want[:16]})")
    return want


# A caller's chunk size is a hint: below this floor one entry would become tens of thousands of
# messages (chunk_bytes=1 turned a 1 MiB entry into ~52,000).
MIN_CHUNK_BYTES = 64 << 10


def stream_chunk(requested: int, default: int, max_message_bytes: int) -> int:
    """The chunk size of a byte stream: the caller's (0: the configured `default`), at least
    MIN_CHUNK_BYTES (or `default`, when an operator configured less) and small enough that a chunk
    plus framing fits one message."""
    limit = max(1, max_message_bytes - 4096)
    return max(1, min(max(int(requested or default), min(MIN_CHUNK_BYTES, default)), limit))


# ---- whole requests ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerModel:
    """What a request is checked against: the worker's model fingerprint, served dtype and
    vocabulary size (HybridEngine.fingerprint, dtype_name(engine.dtype), engine.vocab_size)."""

    fingerprint: str
    dtype: str
    vocab_size: int


@dataclass(frozen=True)
class CheckedPlan:
    """A combine plan that passed check_plan: its canonical mode, the seam window that mode uses,
    each segment's token ids and key (segment_key of its tokens; "" for modes without entries)
    and the query's token ids."""

    mode: str
    seam: int
    segments: list[list[int]]
    keys: list[str]
    query: list[int]


PLAN_SOURCES = frozenset({combine_pb.SOURCE_SEGCACHE, combine_pb.SOURCE_SCATTER, combine_pb.SOURCE_LOCAL})


def check_tokens(token_ids: Sequence[int], vocab_size: int, what: str = "") -> list[int]:
    """The token ids as ints; INVALID_ARGUMENT for one outside [0, vocab_size)."""
    ids = [int(t) for t in token_ids]
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        prefix = f"{what}: " if what else ""
        raise Abort.invalid(f"{prefix}token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return ids


def check_mode(value: int) -> str:
    """The canonical mode of a PrefillMode value; INVALID_ARGUMENT when it is not one."""
    try:
        return from_wire(value)
    except ValueError as e:
        raise Abort.invalid(str(e)) from None


def _check_plan_limits(plan: Any, max_new_tokens: int, max_prompt_tokens: int) -> None:
    if not plan.segments:
        raise Abort.invalid("no segments")
    if not plan.query:
        raise Abort.invalid("empty query: the next-token logits come from the query's last token")
    if plan.max_tokens == 0:
        raise Abort.invalid("max_tokens must be > 0")
    if plan.max_tokens > max_new_tokens:
        raise Abort.invalid(f"max_tokens {plan.max_tokens} > {max_new_tokens}")
    check_temperature(plan.temperature)
    check_seam(plan.seam)
    if not (math.isfinite(plan.top_p) and 0 <= plan.top_p <= 1):
        raise Abort.invalid("top_p must be in [0, 1]")
    total = sum(len(s.token_ids) for s in plan.segments) + len(plan.query)
    if total > max_prompt_tokens:
        raise Abort.invalid(f"prompt of {total} tokens; at most {max_prompt_tokens}")


def _check_planned_segment(plan: Any, i: int, s: Any, vocab_size: int) -> list[int]:
    if not s.token_ids:
        raise Abort.invalid(f"segment {i} is empty")
    if s.source not in PLAN_SOURCES:
        raise Abort.invalid(f"segment {i}: unknown source {s.source}")
    n_addr = len(plan.scatter_addresses)
    if s.source == combine_pb.SOURCE_SCATTER and s.worker >= n_addr:
        raise Abort.invalid(f"segment {i}: worker {s.worker} but {n_addr} scatter addresses")
    return check_tokens(s.token_ids, vocab_size, f"segment {i}")


def check_plan(plan: Any, worker: WorkerModel, *, max_new_tokens: int, max_prompt_tokens: int) -> CheckedPlan:
    """Every check of a combine Plan before any compute (Abort with INVALID_ARGUMENT or
    FAILED_PRECONDITION on the first that fails): mode, limits, sampling, segments and their
    sources, token ids, model and dtype, keys."""
    mode = check_mode(plan.mode)
    _check_plan_limits(plan, max_new_tokens, max_prompt_tokens)
    segs = [_check_planned_segment(plan, i, s, worker.vocab_size) for i, s in enumerate(plan.segments)]
    query = check_tokens(plan.query, worker.vocab_size, "query")
    check_model(plan.model_fingerprint, plan.dtype, worker_fingerprint=worker.fingerprint,
                worker_dtype=worker.dtype)
    seam = seam_for(mode, int(plan.seam))
    # Only modes that use entries carry keys; the others' keys are never read.
    keyed = uses_entries(mode)
    keys = [expected_key(s.key if keyed else "", ids, fingerprint=worker.fingerprint, seam=seam,
                         dtype=worker.dtype, what=f"segment {i}: key")
            for i, (s, ids) in enumerate(zip(plan.segments, segs))]
    return CheckedPlan(mode=mode, seam=seam, segments=segs, keys=keys, query=query)


def check_build(req: Any, worker: WorkerModel, *, max_segment_tokens: int) -> list[int]:
    """Every check of a scatter BuildRequest before any compute; its token ids."""
    if not req.token_ids:
        raise Abort.invalid("empty segment")
    if len(req.token_ids) > max_segment_tokens:
        raise Abort.invalid(f"{len(req.token_ids)} tokens; at most {max_segment_tokens}")
    ids = check_tokens(req.token_ids, worker.vocab_size)
    check_model(req.model_fingerprint, req.dtype, worker_fingerprint=worker.fingerprint,
                worker_dtype=worker.dtype)
    expected_key(req.key, ids, fingerprint=worker.fingerprint, seam=int(req.seam), dtype=worker.dtype,
                 required=True)
    return ids
