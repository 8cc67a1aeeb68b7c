"""RouterConfig: every knob of the router service.

Flags are `--field-name`, environment variables `HYPIC_ROUTER_FIELD_NAME`; flag > env > default
(common.mesh.config). Address lists are comma-separated, `--scatter-addresses
127.0.0.1:50071,127.0.0.1:50072`, or one DNS name whose every A/AAAA record is a member,
`--scatter-addresses dns:///scatter:50071`, re-resolved every --discovery-refresh-s
(common.mesh.discovery).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common.mesh.fields import field_help
from common.mesh.config import ServiceConfig
from common.mesh.discovery import Target, parse_target
from common.mesh.auth import api_key_field
from common.engine.cut import DEFAULT_CUT_TOKENS
from common.engine.dtypes import check_dtype_name

ENV_PREFIX = "HYPIC_ROUTER_"
MiB = 1 << 20



@dataclass
class RouterConfig(ServiceConfig):  # + metrics_port, metrics_host, log_level, log_json
    """The client-facing router: tokenize, look up, plan (LPT), hand the plan to combine."""

    # --- model ---------------------------------------------------------------------------
    model: Path = field(default=Path("models/hypic-tiny-qwen35"), metadata=field_help(
        "model directory (config.json, *.safetensors, tokenizer files); weights are hashed for "
        "the fingerprint, never loaded"))
    seam: int = field(default=8, metadata=field_help("seam window (tokens recomputed per segment)"))
    dtype: str = field(default="float32", metadata=field_help("entry dtype: float32 | bfloat16 | float16 "
                                                      "(must match scatter and combine)"))
    cut_tokens: int = field(default=DEFAULT_CUT_TOKENS, metadata=field_help(
        "cache a segment longer than this as pieces of at most this many tokens, built in "
        "parallel (common/engine/cut.py; a request's keep_whole turns it off); 0 = never cut"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=field_help("address to bind"))
    port: int = field(default=50051, metadata=field_help("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=field_help("write {port, metrics_port, pid} as JSON here once serving"))
    max_message_bytes: int = field(default=16 * MiB, metadata=field_help("largest gRPC message, each way"))
    grace_s: float = field(default=5.0, metadata=field_help("graceful-shutdown grace period"))
    # --- the mesh ------------------------------------------------------------------------
    segcache_address: str = field(default="", metadata=field_help(
        "segcache host:port, a comma-separated list, or dns:///name:port (every record a member, "
        "re-resolved every discovery_refresh_s); each key on one instance, by rendezvous hashing "
        "over the healthy ones; empty = no cache (every segment is a miss, nothing stored)"))
    scatter_addresses: str = field(default="", metadata=field_help(
        "scatter workers: host:port list, comma-separated, or dns:///name:port (every record a "
        "worker); empty (or no members) = misses are built on combine"))
    combine_addresses: str = field(default="127.0.0.1:50081", metadata=field_help(
        "combines: host:port list, comma-separated, or dns:///name:port (least loaded first, "
        "the next on UNAVAILABLE)"))
    discovery_refresh_s: float = field(default=2.0, metadata=field_help(
        "how often dns:/// address targets are re-resolved"))
    # --- limits --------------------------------------------------------------------------
    max_prompt_tokens: int = field(default=0, metadata=field_help(
        "longest prompt (segments + query); 0 = the model's own limit (the smallest of config's "
        "max_position_embeddings and the tokenizer's model_max_length; 32768 when neither says)"))
    max_segments: int = field(default=1024, metadata=field_help("most segments in one request"))
    max_tokens_limit: int = field(default=4096, metadata=field_help("largest max_tokens accepted"))
    max_in_flight: int = field(default=64, metadata=field_help("requests in flight before "
                                                       "RESOURCE_EXHAUSTED"))
    # --- timeouts (seconds; every downstream call also honours the client's deadline) ----
    lookup_timeout_s: float = field(default=1.0, metadata=field_help(
        "segcache Lookup budget; slower or failing lookups count every segment as a miss"))
    claim_lease_s: float = field(default=10.0, metadata=field_help(
        "build claims: a missed segment is claimed in segcache for this long, so that routers "
        "missing it at once build it once (the others wait for the entry); 0 = off"))
    claim_wait_s: float = field(default=30.0, metadata=field_help(
        "longest wait for a segment another request is building (also at most half of what "
        "is left of the deadline); then it is built here"))
    request_timeout_s: float = field(default=300.0, metadata=field_help(
        "deadline given to combine when the client set none"))
    combine_cooldown_s: float = field(default=2.0, metadata=field_help(
        "a combine that answered UNAVAILABLE is tried last for this long"))
    load_poll_s: float = field(default=1.0, metadata=field_help("Scatter.Load poll period; 0 = off"))
    load_timeout_s: float = field(default=0.5, metadata=field_help("Scatter.Load call timeout"))
    # --- cost model prior: t = a + b·L + c·L² ---------------------------------------------
    cost_a_s: float = field(default=0.02, metadata=field_help("prior fixed cost of one build (s)"))
    cost_b_s: float = field(default=2e-4, metadata=field_help("prior cost per token (s)"))
    cost_c_s: float = field(default=2e-9, metadata=field_help("prior cost per token² (s)"))
    tokenizer_threads: int = field(default=2, metadata=field_help("threads for tokenizing"))
    # --- shadow recompute and the drift guard (issue 26; docs/drift.md) ---------------------
    shadow_rate: float = field(default=0.01, metadata=field_help(
        "fraction of hypic requests whose answer is recomputed in full off the critical path, on "
        "an idle combine, to measure how far reuse moved it; 0 = off"))
    shadow_steps: int = field(default=16, metadata=field_help(
        "generated tokens a shadow recompute teacher-forces and compares (k)"))
    shadow_queue: int = field(default=32, metadata=field_help(
        "shadows waiting for an idle combine; a sampled request finding the queue full is dropped "
        "(and counted)"))
    shadow_idle_wait_s: float = field(default=2.0, metadata=field_help(
        "how long a queued shadow waits for a combine this router has no request on before it is "
        "dropped (no_idle_combine); longer finds idle moments on a busy mesh, and holds the queue longer"))
    drift_kl_max: float = field(default=0.1, metadata=field_help(
        "a shadow whose KL(full || hypic) at the query is above this (nats) is over the threshold: "
        "logged with its request id, and counted by the guard"))
    drift_agreement_min: float = field(default=0.9, metadata=field_help(
        "a shadow whose teacher-forced agreement is below this is over the threshold"))
    drift_window: int = field(default=32, metadata=field_help(
        "shadows the rolling figures (hypic info, the guard) are over"))
    drift_guard: bool = field(default=True, metadata=field_help(
        "widen the seam when the rolling divergence crosses the thresholds (then serve hypic "
        "requests by full recompute past the widest), and step back when it subsides"))
    drift_guard_seams: str = field(default="16,32", metadata=field_help(
        "the wider seam widths the guard steps through after --seam, comma-separated, increasing"))
    drift_guard_hold_s: float = field(default=60.0, metadata=field_help(
        "seconds a guard level is held before it may step back"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    api_key: Optional[str] = api_key_field()

    def __post_init__(self) -> None:
        self.check_server()
        self.model = Path(self.model)
        self.dtype = self.dtype.lower()
        check_dtype_name(self.dtype)
        if self.seam < 0:
            raise ValueError("seam must be >= 0")
        if self.cut_tokens < 0 or 0 < self.cut_tokens <= self.seam:
            # A piece no longer than the seam window would be all seam: nothing cached.
            raise ValueError("cut_tokens must be 0 (never cut) or more than the seam window")
        self.segcache_address = (self.segcache_address or "").strip()
        for name in ("segcache_address", "scatter_addresses", "combine_addresses"):
            try:
                parse_target(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if not self.combine_target.is_dns and not self.combines:
            raise ValueError("at least one combine address is needed (--combine-addresses)")
        if not (self.discovery_refresh_s > 0 and math.isfinite(self.discovery_refresh_s)):
            raise ValueError("discovery_refresh_s must be a finite number > 0")
        if self.max_prompt_tokens < 0:
            raise ValueError("max_prompt_tokens must be >= 0 (0: the model's own limit)")
        if not (0.0 <= self.shadow_rate <= 1.0):
            raise ValueError("shadow_rate must be in [0, 1]")
        if not (0.0 <= self.drift_agreement_min <= 1.0):
            raise ValueError("drift_agreement_min must be in [0, 1]")
        seams = self.guard_seams
        if any(b <= a for a, b in zip([self.seam, *seams], seams)):
            raise ValueError("drift_guard_seams must be increasing widths above --seam")
        for name in ("max_segments", "max_tokens_limit", "max_in_flight", "tokenizer_threads",
                     "shadow_steps", "shadow_queue", "drift_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("claim_lease_s", "claim_wait_s", "shadow_idle_wait_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0")
        for name in ("lookup_timeout_s", "request_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0")
        for name in ("combine_cooldown_s", "load_poll_s", "grace_s", "cost_a_s", "cost_b_s",
                     "cost_c_s", "drift_kl_max", "drift_guard_hold_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def guard_seams(self) -> list[int]:
        """drift_guard_seams as a list of ints (ValueError when one is not a number)."""
        try:
            return [int(w) for w in self.drift_guard_seams.split(",") if w.strip()]
        except ValueError:
            raise ValueError("drift_guard_seams must be comma-separated integers") from None

    @property
    def scatters(self) -> list[str]:
        """scatter_addresses as a list (a dns:/// target: [])."""
        return list(self.scatter_target.static)

    @property
    def combines(self) -> list[str]:
        """combine_addresses as a list (a dns:/// target: [])."""
        return list(self.combine_target.static)

    @property
    def scatter_target(self) -> Target:
        return parse_target(self.scatter_addresses)

    @property
    def combine_target(self) -> Target:
        return parse_target(self.combine_addresses)

    @property
    def cost_prior(self) -> tuple[float, float, float]:
        return (self.cost_a_s, self.cost_b_s, self.cost_c_s)
