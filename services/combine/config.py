"""CombineConfig: every knob of a combine worker.

Flags are `--field-name`, environment variables `HYPIC_COMBINE_FIELD_NAME`; flag > env >
default (common.mesh.config). Sizes accept suffixes: `--max-message-bytes 64MiB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common.mesh.config import ServiceConfig
from common.mesh.auth import write_token_field
from common.engine.dtypes import check_dtype_name

ENV_PREFIX = "HYPIC_COMBINE_"
MiB = 1 << 20
COMPOSE_ORDERS = ("auto", "segment")


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class CombineConfig(ServiceConfig):  # + metrics_port, metrics_host, log_level, log_json
    """A combine worker: composes entries as they arrive, recomputes seams, prefills the query and
    decodes (docs/design.md §3, §5)."""

    # --- model ---------------------------------------------------------------------------
    model: Optional[Path] = field(default=None, metadata=_h("checkpoint directory (required)"))
    dtype: str = field(default="float32", metadata=_h("float32 | bfloat16 | float16"))
    device: str = field(default="cpu", metadata=_h("torch device of the model"))
    threads: int = field(default=0, metadata=_h("torch intra-op threads; 0 = torch's default"))
    max_prompt_tokens: int = field(default=131072, metadata=_h("segments + query, at most"))
    max_new_tokens: int = field(default=4096, metadata=_h("largest max_tokens accepted"))
    warmup: bool = field(default=True, metadata=_h("run one small prompt before serving"))
    compose_order: str = field(default="auto", metadata=_h(
        "auto: a hypic plan's leading run of segcache hits waits for every entry of it and "
        "composes them in one layer-major pass; the rest compose as entries arrive, each run of "
        "consecutive segments in hand in one layer-major pass | segment: always segment by "
        "segment, in prompt order (the plain reference)"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=_h("address to bind"))
    port: int = field(default=50081, metadata=_h("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=_h("write {port, metrics_port, pid} as JSON here once serving"))
    max_message_bytes: int = field(default=64 * MiB, metadata=_h("largest gRPC message, each way"))
    grace_s: float = field(default=5.0, metadata=_h("graceful-shutdown grace period"))
    # --- timeouts ------------------------------------------------------------------------
    default_timeout_s: float = field(default=300.0, metadata=_h(
        "deadline of an Execute whose caller set none"))
    segcache_timeout_s: float = field(default=10.0, metadata=_h(
        "longest wait for one segcache fetch before the segment is rebuilt (capped by the deadline)"))
    background_wait_s: float = field(default=5.0, metadata=_h(
        "longest wait, after the last token, for scatter streams to end (their segcache Puts) "
        "and local stores before the final Timings"))
    connect_timeout_s: float = field(default=3.0, metadata=_h(
        "longest wait to connect to a scatter worker or segcache before trying elsewhere"))
    # --- peers ---------------------------------------------------------------------------
    segcache_address: Optional[str] = field(default=None, metadata=_h(
        "segcache (host:port or a comma-separated list) used when a plan names none; empty = none (every segment is built)"))
    nixl: bool = field(default=True, metadata=_h(
        "read segcache hits with NIXL when both ends have it (else the gRPC stream)"))
    nixl_min_bytes: int = field(default=1 * MiB, metadata=_h(
        "smallest entry read with NIXL; smaller ones come over the gRPC stream, which is faster "
        "for them (no lease round trips, no registration)"))
    store_local_builds: bool = field(default=True, metadata=_h(
        "Put segments this worker built itself into segcache when the plan says store_entries"))
    entry_key_file: Optional[Path] = field(default=None, metadata=_h(
        "file holding the mesh's entry secret (the same for segcache, scatter and combine): entries "
        "are sealed with it and refused unless they open under it (common/engine/pic/seal.py); none = an "
        "unkeyed seal, which binds an entry's header to its tensors but does not stop forgery"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    write_token: Optional[str] = write_token_field("sent with every segcache write (segcache's --write-token)")

    def __post_init__(self) -> None:
        self.check_server()
        if self.model is None:
            raise ValueError("--model (HYPIC_COMBINE_MODEL) is required")
        self.model = Path(self.model)
        check_dtype_name(self.dtype)
        if self.compose_order not in COMPOSE_ORDERS:
            raise ValueError(f"compose_order (--compose-order, {ENV_PREFIX}COMPOSE_ORDER) must be "
                             f"one of {COMPOSE_ORDERS}, not {self.compose_order!r}")
        if self.nixl_min_bytes < 0:
            raise ValueError("nixl_min_bytes must be >= 0")
        if self.threads < 0 or self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("threads must be >= 0, max_prompt_tokens and max_new_tokens >= 1")
        for name in ("default_timeout_s", "segcache_timeout_s", "connect_timeout_s", "grace_s",
                     "background_wait_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0")
        if self.segcache_address is not None and not self.segcache_address.strip():
            self.segcache_address = None
