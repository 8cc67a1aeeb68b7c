"""The checks a model worker (scatter, combine) makes of a request before any compute: that it
was planned for this worker's model and dtype, and that its segment keys are the content
addresses of its tokens. One home, so both workers refuse the same requests with the same status."""
from __future__ import annotations

from typing import Sequence

import grpc

from common.fingerprint import segment_key
from common.rpc.abort import Abort


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
    want = segment_key(fingerprint, seam, dtype, token_ids)
    if (key or required) and key != want:
        raise Abort.invalid(f"{what} {key[:16]!r} is not segment_key(...) of its tokens with seam {seam} "
                            f"({want[:16]})")
    return want
