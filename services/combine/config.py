"""CombineConfig: every knob of a combine worker.

Flags are `--field-name`, environment variables `HYPIC_COMBINE_FIELD_NAME`; flag > env >
default (common.mesh.config). Sizes accept suffixes: `--max-message-bytes 64MiB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from common.mesh.fields import field_help
from common.mesh.config import WorkerConfig
from common.mesh.auth import write_token_field

ENV_PREFIX = "HYPIC_COMBINE_"
MiB = 1 << 20
COMPOSE_ORDERS = ("auto", "segment")
# Faults a drill can inject ("" = none): compose-without-t composes hypic plans' entries as the
# additive ablation does (without T), seams and keys as planned: wrong answers nothing else shows.
FAULTS = ("", "compose-without-t")


@dataclass
class CombineConfig(WorkerConfig):  # + model, dtype, device, threads, entry_key_file; metrics, log, TLS
    """A combine worker: composes entries as they arrive, recomputes seams, prefills the query and
    decodes (docs/design.md §3, §5)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    # --- model ---------------------------------------------------------------------------
    max_prompt_tokens: int = field(default=131072, metadata=field_help("segments + query, at most"))
    max_new_tokens: int = field(default=4096, metadata=field_help("largest max_tokens accepted"))
    warmup: bool = field(default=True, metadata=field_help("run one small prompt before serving"))
    compose_order: str = field(default="auto", metadata=field_help(
        "auto: a hypic plan's leading run of segcache hits waits for every entry of it and "
        "composes them in one layer-major pass; the rest compose as entries arrive, each run of "
        "consecutive segments in hand in one layer-major pass | segment: always segment by "
        "segment, in prompt order (the plain reference)"))
    fault: str = field(default="", metadata=field_help(
        "FOR DRILLS AND TESTS ONLY, never in service: inject a fault that makes answers wrong. "
        "compose-without-t: compose cached entries without T (as the additive ablation does), "
        "seams and keys as planned, so only the shadow monitor can tell"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=field_help("address to bind"))
    port: int = field(default=50081, metadata=field_help("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=field_help("write {port, metrics_port, pid} as JSON here once serving"))
    max_message_bytes: int = field(default=64 * MiB, metadata=field_help("largest gRPC message, each way"))
    grace_s: float = field(default=5.0, metadata=field_help("graceful-shutdown grace period"))
    # --- timeouts ------------------------------------------------------------------------
    default_timeout_s: float = field(default=300.0, metadata=field_help(
        "deadline of an Execute whose caller set none"))
    segcache_timeout_s: float = field(default=10.0, metadata=field_help(
        "longest wait for one segcache fetch before the segment is rebuilt (capped by the deadline)"))
    background_wait_s: float = field(default=5.0, metadata=field_help(
        "longest wait, after the last token, for scatter streams to end (their segcache Puts) "
        "and local stores before the final Timings"))
    connect_timeout_s: float = field(default=3.0, metadata=field_help(
        "longest wait to connect to a scatter worker or segcache before trying elsewhere"))
    # --- peers ---------------------------------------------------------------------------
    segcache_address: Optional[str] = field(default=None, metadata=field_help(
        "segcache (host:port, a comma-separated list or dns:///name:port) used when a plan names none; "
        "empty = none (every segment is built)"))
    nixl: bool = field(default=True, metadata=field_help(
        "read segcache hits with NIXL when both ends have it (else the gRPC stream)"))
    nixl_min_bytes: int = field(default=1 * MiB, metadata=field_help(
        "smallest entry read with NIXL; smaller ones come over the gRPC stream, which is faster "
        "for them (no lease round trips, no registration)"))
    store_local_builds: bool = field(default=True, metadata=field_help(
        "Put segments this worker built itself into segcache when the plan says store_entries"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    write_token: Optional[str] = write_token_field("sent with every segcache write (segcache's --write-token)")

    def __post_init__(self) -> None:
        self.check_worker()
        if self.compose_order not in COMPOSE_ORDERS:
            raise ValueError(f"compose_order (--compose-order, {ENV_PREFIX}COMPOSE_ORDER) must be "
                             f"one of {COMPOSE_ORDERS}, not {self.compose_order!r}")
        if self.fault not in FAULTS:
            raise ValueError(f"fault (--fault, {ENV_PREFIX}FAULT) must be one of {FAULTS}, not {self.fault!r}")
        if self.nixl_min_bytes < 0:
            raise ValueError("nixl_min_bytes must be >= 0")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("max_prompt_tokens and max_new_tokens must be >= 1")
        for name in ("default_timeout_s", "segcache_timeout_s", "connect_timeout_s", "grace_s",
                     "background_wait_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0")
        if self.segcache_address is not None and not self.segcache_address.strip():
            self.segcache_address = None

    @property
    def compose_without_t(self) -> bool:
        """The compose-without-t fault is on (segment by segment, bodies applied without T)."""
        return self.fault == "compose-without-t"
