"""ScatterConfig: every knob of a scatter worker.

Flags are `--field-name`, environment variables `HYPIC_SCATTER_FIELD_NAME`; flag > env >
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

ENV_PREFIX = "HYPIC_SCATTER_"
MiB = 1 << 20


@dataclass
class ScatterConfig(WorkerConfig):  # + model, dtype, device, threads, entry_key_file; metrics, log, TLS
    """A scatter worker: prefills one segment alone and builds its entry (docs/design.md §4)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    # --- model ---------------------------------------------------------------------------
    max_segment_tokens: int = field(default=131072, metadata=field_help("longest segment accepted"))
    warmup: bool = field(default=True, metadata=field_help("run one small build before serving"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=field_help("address to bind"))
    port: int = field(default=50071, metadata=field_help("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=field_help("write {port, metrics_port, pid, worker} as JSON here once serving"))
    worker: str = field(default="", metadata=field_help("worker name in answers and logs; "
                                                "empty = scatter@HOST:PORT"))
    max_message_bytes: int = field(default=64 * MiB, metadata=field_help("largest gRPC message, each way"))
    chunk_bytes: int = field(default=1 * MiB, metadata=field_help("Build stream chunk size (default)"))
    grace_s: float = field(default=5.0, metadata=field_help("graceful-shutdown grace period"))
    # --- segcache --------------------------------------------------------------------------
    segcache_address: Optional[str] = field(default=None, metadata=field_help(
        "segcache host:port (or a comma-separated list, or dns:///name:port: each key on its "
        "rendezvous instance) "
        "where built entries are stored (store=true); empty = never store"))
    segcache_timeout_s: float = field(default=30.0, metadata=field_help("timeout of one segcache Put"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    write_token: Optional[str] = write_token_field("sent with every segcache write (segcache's --write-token)")

    def __post_init__(self) -> None:
        self.check_worker()
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.chunk_bytes = min(self.chunk_bytes, self.max_message_bytes - 4096)
        if self.max_segment_tokens < 1:
            raise ValueError("max_segment_tokens must be >= 1")
        if not (self.segcache_timeout_s > 0 and math.isfinite(self.segcache_timeout_s)):
            raise ValueError("segcache_timeout_s must be > 0")
        if self.segcache_address is not None and not self.segcache_address.strip():
            self.segcache_address = None
