"""What the SDK sends and gets back: the request builder (segments and query as text or token
ids, the prefill mode by name) and the typed results (Token, Timings, GenerateResult, Info), with
the fold of a GenerateEvent stream into them (hypic.client uses it for both clients).
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Sequence, Union

from hypic import errors
from protos.hypic.v1 import router_pb2 as router_pb

# Prefill mode names, read off the proto enum (PREFILL_MODE_ADDITIVE -> "additive"): the wire
# contract is their one home on this side. "naive" (the additive ablation's old name, an enum
# alias) is accepted for one version; MODE_NAMES are the canonical ones.
MODES = {name.removeprefix("PREFILL_MODE_").lower(): value for name, value in router_pb.PrefillMode.items()}
MODE_NAMES = tuple(name for name, value in MODES.items()
                   if router_pb.PrefillMode.Name(value) == "PREFILL_MODE_" + name.upper())
MODE_OF_VALUE = {MODES[name]: name for name in MODE_NAMES}  # wire value -> canonical name

SegmentLike = Union[str, Sequence[int]]


# ---- result types ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Token:
    id: int
    text: str          # detokenized piece ("" when the router has no tokenizer, or mid-character)
    index: int         # 0 for the first generated token
    logits: list[float] | None = None   # first token only, with return_logits=True


@dataclass(frozen=True)
class SegmentTrace:
    """Where one segment's entry came from: "segcache" (tier), "scatter" (worker) or "local"."""
    index: int
    source: str
    worker: str = ""
    tier: str = ""
    fetch_s: float = 0.0
    build_s: float = 0.0
    tokens: int = 0
    via_nixl: bool = False


@dataclass(frozen=True)
class Timings:
    """Where each segment came from and how long each stage took (seconds)."""
    tokenize_s: float = 0.0
    lookup_s: float = 0.0
    scatter_s: float = 0.0
    transfer_s: float = 0.0
    compose_s: float = 0.0
    seams_s: float = 0.0
    query_prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    segments: int = 0
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0    # prompt tokens served from cache (segcache hits' bodies)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    trace: tuple[SegmentTrace, ...] = ()  # per segment, in the final timings
    recomputed: int = 0       # segments recomputed in full (full mode; prefix: past the cached prefix)
    seam: int = 0             # the seam width the entries were composed with (0 in full/prefix)
    served_mode: str = "hypic"  # the mode the request was served in (the drift guard may change it)
    shadowed: bool = False    # sampled for a shadow recompute (drift monitoring)

    @property
    def served(self) -> "Served":
        return Served.from_timings(self)

    @classmethod
    def from_proto(cls, t: router_pb.Timings) -> "Timings":
        return cls(tokenize_s=t.tokenize_s, lookup_s=t.lookup_s, scatter_s=t.scatter_s,
                   transfer_s=t.transfer_s, compose_s=t.compose_s, seams_s=t.seams_s,
                   query_prefill_s=t.query_prefill_s, ttft_s=t.ttft_s, total_s=t.total_s,
                   segments=t.segments, hits=t.hits, misses=t.misses,
                   prompt_tokens=t.prompt_tokens, hits_by_tier=dict(t.hits_by_tier),
                   cached_tokens=t.cached_tokens,
                   cached_tokens_by_tier=dict(t.cached_tokens_by_tier),
                   trace=tuple(SegmentTrace(index=s.index, source=s.source, worker=s.worker, tier=s.tier,
                                            fetch_s=s.fetch_s, build_s=s.build_s, tokens=s.tokens,
                                            via_nixl=s.via_nixl) for s in t.trace),
                   recomputed=t.recomputed, seam=t.seam,
                   served_mode=MODE_OF_VALUE.get(t.served_mode, str(t.served_mode)), shadowed=t.shadowed)


@dataclass(frozen=True)
class Served:
    """How the router served one request, segment by segment (a segment is a cache piece: the
    router cuts long segments, and Timings.segments counts the pieces).

    reused      segments whose cached state was used as is: segcache hits (hypic, additive),
                or the cached prefix combine reused exactly (prefix)
    built       segments built as entries for this request (scatter or combine; stored for later)
    recomputed  segments recomputed in full: every one in full mode, those past the reused
                prefix in prefix mode, none when entries are composed (hypic, additive)
    seam        the seam width entries were composed with (0 in full, prefix and additive)
    mode        the mode served: the one asked for, unless the drift guard served a hypic request
                by full or prefix recompute
    shadowed    sampled for a shadow recompute (the drift monitor; off the request's path)
    """
    reused: int
    built: int
    recomputed: int
    seam: int
    mode: str
    shadowed: bool

    @classmethod
    def from_timings(cls, t: Timings) -> "Served":
        # prefix mode reuses combine's own prefix cache, not segcache: what it did not recompute
        reused = max(0, t.segments - t.recomputed) if t.served_mode == "prefix" else t.hits
        return cls(reused=reused, built=t.misses, recomputed=t.recomputed, seam=t.seam,
                   mode=t.served_mode, shadowed=t.shadowed)


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    timings: Timings | None
    logits: list[float] | None
    request_id: str

    @property
    def served(self) -> Served | None:
        """How the request was served (reused, built, recomputed, seam, mode, shadowed)."""
        return self.timings.served if self.timings is not None else None


@dataclass(frozen=True)
class DriftHistogram:
    """One figure ("kl" or "agreement") over every shadow served at one seam width, in buckets:
    counts[i] fell at or under upper_bounds[i] (and over the bound before); counts[-1] over the
    largest bound."""
    figure: str
    seam: int
    upper_bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @classmethod
    def from_proto(cls, h: router_pb.DriftHistogram) -> "DriftHistogram":
        return cls(h.figure, h.seam, tuple(h.upper_bounds), tuple(h.counts), h.sum)


@dataclass(frozen=True)
class DriftSummary:
    """The router's shadow recompute figures (docs/drift.md): counts since start, and the means
    over the last `window` shadows; guard_*: the drift guard's state."""
    sample_rate: float = 0.0
    sampled: int = 0
    shadowed: int = 0
    dropped: int = 0
    over_threshold: int = 0
    window: int = 0
    kl_mean: float = 0.0
    top1_rate: float = 0.0
    agreement_mean: float = 0.0
    guard_enabled: bool = False
    guard_seam: int = 0
    guard_full: bool = False
    histograms: tuple[DriftHistogram, ...] = ()

    @classmethod
    def from_proto(cls, d: router_pb.DriftSummary) -> "DriftSummary":
        kw = {f.name: getattr(d, f.name) for f in fields(cls) if f.name != "histograms"}
        return cls(**kw, histograms=tuple(DriftHistogram.from_proto(h) for h in d.histograms))


@dataclass(frozen=True)
class Info:
    model_type: str
    model_fingerprint: str
    vocab_size: int
    seam: int
    dtype: str
    max_prompt_tokens: int
    scatter_addresses: list[str]
    combine_addresses: list[str]
    segcache_address: str
    model_path: str = ""  # the router's model directory
    drift: DriftSummary = field(default_factory=DriftSummary)  # the shadow monitor's figures

    @classmethod
    def from_proto(cls, r: router_pb.InfoResponse) -> "Info":
        return cls(model_type=r.model_type, model_fingerprint=r.model_fingerprint,
                   vocab_size=r.vocab_size, seam=r.seam, dtype=r.dtype,
                   max_prompt_tokens=r.max_prompt_tokens,
                   scatter_addresses=list(r.scatter_addresses),
                   combine_addresses=list(r.combine_addresses),
                   segcache_address=r.segcache_address, model_path=r.model_path,
                   drift=DriftSummary.from_proto(r.drift))


# ---- request building ----------------------------------------------------------------------------

def _segment(value: Any, what: str) -> router_pb.Segment:
    if isinstance(value, router_pb.Segment):
        return value
    if isinstance(value, str):
        return router_pb.Segment(text=value)
    if isinstance(value, (bytes, bytearray)):
        raise errors.InvalidArgument(f"{what}: pass text as str, not bytes")
    try:
        ids = [int(t) for t in value]
    except (TypeError, ValueError):
        raise errors.InvalidArgument(f"{what}: expected str or a list of token ids, "
                                     f"got {type(value).__name__}") from None
    if any(t < 0 or t >= 1 << 32 for t in ids):
        raise errors.InvalidArgument(f"{what}: token ids must be in [0, 2^32)")
    return router_pb.Segment(token_ids=ids)


def build_request(segments: Sequence[SegmentLike], query: SegmentLike, *, max_tokens: int = 16,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  mode: str = "hypic", return_logits: bool = False, stop_at_eos: bool = True,
                  request_id: str | None = None, keep_whole: bool = False) -> router_pb.GenerateRequest:
    """The GenerateRequest for these arguments (client-side type checks only; the router
    validates the content). keep_whole: the router caches every segment whole instead of
    cutting one longer than its --cut-tokens into pieces built in parallel."""
    if isinstance(segments, (str, bytes)) or isinstance(segments, router_pb.Segment):
        raise errors.InvalidArgument("segments must be a list (of str or token-id lists)")
    mode_value = MODES.get(mode.strip().lower()) if isinstance(mode, str) else (
        mode if mode in MODES.values() else None)
    if mode_value is None:
        raise errors.InvalidArgument(f"unknown mode {mode!r}; one of {', '.join(MODE_NAMES)}")
    if not isinstance(max_tokens, int) or max_tokens < 0 or max_tokens >= 1 << 32:
        raise errors.InvalidArgument("max_tokens must be an int > 0")
    return router_pb.GenerateRequest(
        segments=[_segment(s, f"segment {i}") for i, s in enumerate(segments)],
        query=_segment(query, "query"), max_tokens=max_tokens, temperature=float(temperature),
        top_k=int(top_k), top_p=float(top_p), seed=int(seed), mode=mode_value,
        return_logits=bool(return_logits), stop_at_eos=bool(stop_at_eos),
        request_id=request_id or uuid.uuid4().hex[:16], keep_whole=bool(keep_whole))


class Accumulator:
    """Folds GenerateEvents into tokens, text, logits and the latest timings."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.logits: list[float] | None = None
        self.timings: Timings | None = None
        self.done = False
        self.pending: deque[Token] = deque()  # read ahead (to a Timings), not yet handed out

    def feed(self, ev: router_pb.GenerateEvent) -> Token | None:
        if ev.request_id:
            self.request_id = ev.request_id
        kind = ev.WhichOneof("event")
        out = None
        if kind == "token":
            t = ev.token
            logits = list(t.logits) if len(t.logits) else None
            if logits is not None and self.logits is None:
                self.logits = logits
            self.tokens.append(t.token_id)
            self.pieces.append(t.text)
            out = Token(id=t.token_id, text=t.text, index=t.index, logits=logits)
        elif kind == "timings":
            self.timings = Timings.from_proto(ev.timings)
        if ev.done:
            self.done = True
        return out

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def result(self) -> GenerateResult:
        return GenerateResult(tokens=list(self.tokens), text=self.text, timings=self.timings,
                              logits=self.logits, request_id=self.request_id)
