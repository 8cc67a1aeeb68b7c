"""Combine.Shadow (issue 26, docs/drift.md): the answer's prefix recomputed in full, off the
request's critical path, and compared with what hypic served (common.engine.drift.measure_drift).

Shadows run on idle capacity only: while combine is serving an Execute, or running another
shadow, the call is refused with RESOURCE_EXHAUSTED (the router drops that shadow and counts it)
rather than queued behind user requests. The computation runs on the engine thread, like every
model call, so it never runs the model at once with a request.
"""

from __future__ import annotations

import math
import time

import grpc
import structlog
import torch

from common.engine.drift import measure_drift
from common.mesh.abort import Abort
from common.mesh.log import sanitize_request_id
from protos.hypic.v1 import combine_pb2 as combine_pb
from services.combine import metrics as m

log = structlog.get_logger("combine.shadow")

# The most teacher-forced steps one shadow may ask for: the router sends --shadow-steps (16 by
# default); the bound keeps one shadow's compute (and a forged request's) small.
MAX_SHADOW_STEPS = 256


def check_shadow(request: combine_pb.ShadowRequest, fingerprint: str, vocab_size: int,
                 max_prompt_tokens: int) -> torch.Tensor:
    """hypic's query logits as a tensor, once the request is valid (else Abort INVALID_ARGUMENT)."""
    if request.model_fingerprint != fingerprint:
        raise Abort.invalid(f"shadow for model {request.model_fingerprint[:16]!r}, this combine serves "
                            f"{fingerprint[:16]!r}")
    if not request.prompt:
        raise Abort.invalid("shadow prompt is empty")
    if len(request.prompt) > max_prompt_tokens:
        raise Abort.invalid(f"shadow prompt of {len(request.prompt)} tokens is over max_prompt_tokens "
                            f"({max_prompt_tokens})")
    if len(request.generated) != len(request.hypic_argmax):
        raise Abort.invalid(f"{len(request.generated)} generated tokens but {len(request.hypic_argmax)} "
                            "greedy picks")
    if len(request.generated) > MAX_SHADOW_STEPS:
        raise Abort.invalid(f"{len(request.generated)} shadow steps; at most {MAX_SHADOW_STEPS}")
    for name in ("prompt", "generated", "hypic_argmax"):
        ids = getattr(request, name)
        if ids and max(ids) >= vocab_size:
            raise Abort.invalid(f"shadow {name}: token id {max(ids)} outside the vocabulary [0, {vocab_size})")
    if len(request.hypic_logits) != vocab_size:
        raise Abort.invalid(f"{len(request.hypic_logits)} hypic logits; the vocabulary has {vocab_size}")
    logits = torch.tensor(request.hypic_logits, dtype=torch.float32)
    if not bool(torch.isfinite(logits).all()):
        raise Abort.invalid("hypic logits must be finite")
    return logits


class ShadowRPC:
    """Combine.Shadow, mixed into CombineServicer (which has engine, cfg, in_flight and run)."""

    shadow_running = False

    async def Shadow(self, request: combine_pb.ShadowRequest, context) -> combine_pb.ShadowResult:
        rid = sanitize_request_id(request.request_id)
        try:
            logits = check_shadow(request, self.engine.fingerprint, self.engine.vocab_size,  # type: ignore[attr-defined]
                                  self.cfg.max_prompt_tokens)  # type: ignore[attr-defined]
            if self.in_flight > 0 or self.shadow_running:  # type: ignore[attr-defined]
                m.SHADOWS.labels("busy").inc()
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "combine is busy: shadows run on idle capacity only")
        except Abort as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                m.SHADOWS.labels("invalid").inc()
                log.info("shadow rejected", request_id=rid, details=e.details)
            await e.send(context)
        self.shadow_running = True
        t = time.perf_counter()
        try:
            drift = await self.run(self._measure, request, logits)  # type: ignore[attr-defined]
        except Exception:
            m.SHADOWS.labels("error").inc()
            raise  # the guard interceptor logs it and answers INTERNAL
        finally:
            self.shadow_running = False
        compute_s = time.perf_counter() - t
        m.SHADOWS.labels("computed").inc()
        log.info("shadow computed", request_id=rid, kl=round(drift.kl, 6), top1_agree=drift.top1_agree,
                 agreement=round(drift.agreement, 4), steps=drift.steps, compute_s=round(compute_s, 4))
        return combine_pb.ShadowResult(kl=drift.kl if math.isfinite(drift.kl) else 0.0,
                                       top1_agree=drift.top1_agree, agreement=drift.agreement,
                                       steps=drift.steps, compute_s=compute_s)

    @torch.inference_mode()
    def _measure(self, request: combine_pb.ShadowRequest, logits: torch.Tensor):
        """Engine thread: full recompute of the prompt and the generated tokens, compared."""
        return measure_drift(self.engine, list(request.prompt), list(request.generated),  # type: ignore[attr-defined]
                             list(request.hypic_argmax), logits)
