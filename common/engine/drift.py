"""How far a reused answer drifts from full recompute (issue 26): the figures the online shadow
monitor (router -> combine's Shadow RPC) and the offline quality evaluation (bench/quality) both
report, computed by the same functions so that the two can be compared.

- KL(full || hypic) of the next-token distributions at the query, in nats;
- top-1 agreement at the query (the two argmaxes are the same token);
- teacher-forced agreement over the first k generated steps: full recompute is fed the tokens
  hypic generated, and at each step its argmax is compared with hypic's greedy pick there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from common.engine.hybrid_engine import HybridEngine


@dataclass(frozen=True)
class Drift:
    kl: float            # KL(full || hypic) at the query, nats
    top1_agree: bool     # argmax of full == argmax of hypic at the query
    agreement: float     # fraction of the teacher-forced steps whose argmaxes agree
    steps: int           # how many steps `agreement` is over


def query_divergence(full_logits: torch.Tensor, hypic_logits: torch.Tensor) -> tuple[float, bool]:
    """KL(full || hypic) in nats (fp32, from logits of any dtype) and whether the argmaxes agree."""
    if full_logits.shape != hypic_logits.shape or full_logits.dim() != 1:
        raise ValueError(f"logits must be two vectors of one size, got {tuple(full_logits.shape)} "
                         f"and {tuple(hypic_logits.shape)}")
    p_log = F.log_softmax(full_logits.detach().float().cpu(), dim=-1)
    q_log = F.log_softmax(hypic_logits.detach().float().cpu(), dim=-1)
    kl = float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))
    return kl, int(full_logits.argmax()) == int(hypic_logits.argmax())


def step_agreement(full_step_logits: torch.Tensor, hypic_picks: Sequence[int]) -> float:
    """The fraction of steps where full recompute's argmax is hypic's greedy pick (1.0 for none)."""
    if len(hypic_picks) == 0:
        return 1.0
    if full_step_logits.dim() != 2 or full_step_logits.shape[0] != len(hypic_picks):
        raise ValueError(f"need one row of logits per step: {tuple(full_step_logits.shape)} for "
                         f"{len(hypic_picks)} steps")
    full_picks = full_step_logits.argmax(dim=-1).cpu()
    return float((full_picks == torch.tensor(list(hypic_picks), dtype=full_picks.dtype)).float().mean())


def full_recompute_logits(engine: "HybridEngine", prompt: Sequence[int],
                          generated: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full recompute of `prompt`, then `generated` teacher-forced: the logits at the query (the
    prompt's last position, which predicts generated[0]) and one row per generated step [k, V]
    (row j predicts generated[j]; row 0 is the query's). Only the k rows are materialised."""
    out = engine.prefill(prompt)
    query_logits = out.logits
    rows = [query_logits.unsqueeze(0)]
    if len(generated) > 1:
        _, more, _ = engine.forward(list(generated[:-1]), out.state, all_logits=True)
        rows.append(more)
    return query_logits, torch.cat(rows, 0)


def measure_drift(engine: "HybridEngine", prompt: Sequence[int], generated: Sequence[int],
                  hypic_argmax: Sequence[int], hypic_logits: torch.Tensor) -> Drift:
    """The drift of one answer: full recompute of `prompt` + `generated` (teacher-forced) against
    hypic's logits at the query and its greedy picks at each generated step."""
    if len(generated) != len(hypic_argmax):
        raise ValueError(f"{len(generated)} generated tokens but {len(hypic_argmax)} greedy picks")
    query_logits, step_logits = full_recompute_logits(engine, prompt, generated)
    kl, top1 = query_divergence(query_logits, hypic_logits.to(query_logits.device))
    agreement = step_agreement(step_logits[: len(generated)], hypic_argmax) if generated else float(top1)
    return Drift(kl=kl, top1_agree=top1, agreement=agreement, steps=max(len(generated), 1))
