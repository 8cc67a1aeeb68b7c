"""The router's state of one Generate call (RequestState) and the Timings it reports from it.

Kept apart from the servicer, which drives the call: this is the bookkeeping (what was planned,
which segments arrived from where, the stage times) and the one place Timings are assembled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.engine import modes
from protos.hypic.v1 import combine_pb2 as combine_pb
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from services.router.planner import Ticket


def tier_name(tier: int) -> str:
    """'device' | 'host' | 'disk' for a segcache Tier."""
    return segcache_pb.Tier.Name(tier).removeprefix("TIER_").lower() if tier in segcache_pb.Tier.values() else str(tier)


def norm_tier(text: str) -> str:
    """A tier name as combine reports it ("TIER_HOST", "host") in the form of tier_name."""
    return text.strip().lower().removeprefix("tier_")


@dataclass
class RequestState:
    """One Generate call as the router follows it: what it asked, what was planned, what arrived."""

    rid: str
    mode: int
    t0: float
    deadline: float
    segments: list[list[int]] = field(default_factory=list)
    query: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    tokenize_s: float = 0.0
    lookup_s: float = 0.0
    planned_tiers: dict[int, str] = field(default_factory=dict)   # segment index -> tier (hits)
    planned_misses: int = 0
    ticket: Ticket | None = None
    ready: dict[int, tuple[int, str]] = field(default_factory=dict)  # index -> (source, tier)
    trace: dict[int, router_pb.SegmentTrace] = field(default_factory=dict)  # index -> where it came from
    combine_timings: router_pb.Timings = field(default_factory=router_pb.Timings)
    ttft_s: float = 0.0
    tokens_sent: int = 0
    seam: int = 0                  # the plan's seam window (cached bodies exclude it)
    shadowed: bool = False         # sampled for a shadow recompute (services/router/shadow.py)

    @property
    def mode_name(self) -> str:
        try:
            return modes.from_wire(self.mode)
        except ValueError:
            return "unknown"  # metric labels come from a closed set

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def timings(self, final: bool) -> router_pb.Timings:
        """The Timings to send: combine's, completed with the router's stages, hits and cached
        tokens (by what arrived, else by what combine counted, else by the plan); final adds the
        trace and the total."""
        t = router_pb.Timings()
        t.CopyFrom(self.combine_timings)
        t.tokenize_s = self.tokenize_s
        t.lookup_s = self.lookup_s
        t.ttft_s = self.ttft_s
        t.total_s = time.perf_counter() - self.t0 if final else self.ttft_s
        t.segments = len(self.segments)
        t.prompt_tokens = self.prompt_tokens
        t.ClearField("hits_by_tier")
        if final:
            t.trace.extend(self.trace[i] for i in sorted(self.trace))
        if self.ready:
            hits = [tier for src, tier in self.ready.values() if src == combine_pb.SOURCE_SEGCACHE]
            t.hits = len(hits)
            t.misses = len(self.ready) - len(hits)
            tiers = hits
        elif self.combine_timings.hits or self.combine_timings.misses:
            tiers = []
            t.hits_by_tier.update(self.combine_timings.hits_by_tier)
        else:
            tiers = list(self.planned_tiers.values())
            t.hits = len(tiers)
            t.misses = self.planned_misses
        for tier in tiers:
            key = tier or "unknown"
            t.hits_by_tier[key] = t.hits_by_tier.get(key, 0) + 1
        self._cached_tokens(t)
        return t

    def _cached_tokens(self, t: router_pb.Timings) -> None:
        """Tokens served from cache: each segcache hit's body (its seam window is recomputed)."""
        hits = {i: tier for i, (src, tier) in self.ready.items() if src == combine_pb.SOURCE_SEGCACHE} \
            if self.ready else dict(self.planned_tiers)
        t.cached_tokens = 0
        t.ClearField("cached_tokens_by_tier")
        for i, tier in hits.items():
            if i >= len(self.segments):
                continue
            body = max(0, len(self.segments[i]) - self.seam)
            key = tier or "unknown"
            t.cached_tokens += body
            t.cached_tokens_by_tier[key] = t.cached_tokens_by_tier.get(key, 0) + body
