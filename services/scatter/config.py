"""ScatterConfig: every knob of a scatter worker.

Flags are `--field-name`, environment variables `HYPIC_SCATTER_FIELD_NAME`; flag > env >
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

ENV_PREFIX = "HYPIC_SCATTER_"
MiB = 1 << 20


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class ScatterConfig(ServiceConfig):  # + metrics_port, metrics_host, log_level, log_json
    """A scatter worker: prefills one segment alone and builds its entry (docs/design.md §4)."""

    # --- model ---------------------------------------------------------------------------
    model: Optional[Path] = field(default=None, metadata=_h("checkpoint directory (required)"))
    dtype: str = field(default="float32", metadata=_h("float32 | bfloat16 | float16"))
    device: str = field(default="cpu", metadata=_h("torch device of the model"))
    threads: int = field(default=0, metadata=_h("torch intra-op threads; 0 = torch's default"))
    max_segment_tokens: int = field(default=131072, metadata=_h("longest segment accepted"))
    warmup: bool = field(default=True, metadata=_h("run one small build before serving"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=_h("address to bind"))
    port: int = field(default=50071, metadata=_h("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=_h("write {port, metrics_port, pid, worker} as JSON here once serving"))
    worker: str = field(default="", metadata=_h("worker name in answers and logs; "
                                                "empty = scatter@HOST:PORT"))
    max_message_bytes: int = field(default=64 * MiB, metadata=_h("largest gRPC message, each way"))
    chunk_bytes: int = field(default=1 * MiB, metadata=_h("Build stream chunk size (default)"))
    grace_s: float = field(default=5.0, metadata=_h("graceful-shutdown grace period"))
    # --- segcache --------------------------------------------------------------------------
    segcache_address: Optional[str] = field(default=None, metadata=_h(
        "segcache host:port (or a comma-separated list: each key on its rendezvous instance) "
        "where built entries are stored (store=true); empty = never store"))
    segcache_timeout_s: float = field(default=30.0, metadata=_h("timeout of one segcache Put"))
    entry_key_file: Optional[Path] = field(default=None, metadata=_h(
        "file holding the mesh's entry secret (the same for segcache, scatter and combine): entries "
        "are sealed with it and refused unless they open under it (common/engine/pic/seal.py); none = an "
        "unkeyed seal, which binds an entry's header to its tensors but does not stop forgery"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    write_token: Optional[str] = write_token_field("sent with every segcache write (segcache's --write-token)")

    def __post_init__(self) -> None:
        self.check_server()
        if self.model is None:
            raise ValueError("--model (HYPIC_SCATTER_MODEL) is required")
        self.model = Path(self.model)
        check_dtype_name(self.dtype)
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.chunk_bytes = min(self.chunk_bytes, self.max_message_bytes - 4096)
        if self.threads < 0 or self.max_segment_tokens < 1:
            raise ValueError("threads must be >= 0, max_segment_tokens >= 1")
        if not (self.segcache_timeout_s > 0 and math.isfinite(self.segcache_timeout_s)):
            raise ValueError("segcache_timeout_s must be > 0")
        if self.segcache_address is not None and not self.segcache_address.strip():
            self.segcache_address = None
