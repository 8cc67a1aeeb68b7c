"""The checks a model worker (scatter, combine) makes of a request before any compute: that it
was planned for this worker's model and dtype, and that its segment keys are the content
addresses of its tokens. One home, so both workers refuse the same requests with the same status."""
from __future__ import annotations

import math
from typing import Sequence

import grpc

from common.engine.fingerprint import segment_key
from common.mesh.abort import Abort


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
