"""SegcacheConfig: every knob of the segcache service.

Flags are `--field-name`, environment variables `HYPIC_SEGCACHE_FIELD_NAME`; flag > env >
default (common.mesh.config). Sizes accept suffixes: `--host-bytes 8GiB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common.mesh.fields import field_help
from common.mesh.config import ServiceConfig
from common.mesh.auth import write_token_field
from services.segcache.remote_tier import parse_remote_url

ENV_PREFIX = "HYPIC_SEGCACHE_"
GiB = 1 << 30
WILDCARDS = ("", "0.0.0.0", "::", "[::]")  # bind addresses that no peer can dial
MiB = 1 << 20



@dataclass
class SegcacheConfig(ServiceConfig):  # + metrics_port, metrics_host, log_level, log_json
    """The tiered segment cache (tier 0 device, tier 1 host DRAM, tier 2 LMDB)."""

    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=field_help("address to bind"))
    advertise_host: str = field(default="", metadata=field_help(
        "the address other segcaches reach this one at through the remote tier (Mooncake's "
        "local_hostname: a name or IP, e.g. the compose service name or the pod IP); empty = host, "
        "which must then not be a wildcard (0.0.0.0, ::) when the remote tier is on"))
    port: int = field(default=50061, metadata=field_help("gRPC port; 0 = ephemeral"))
    port_file: Optional[Path] = field(
        default=None, metadata=field_help("write {port, metrics_port, pid} as JSON here once serving"))
    max_message_bytes: int = field(default=2 * MiB, metadata=field_help(
        "largest gRPC message, each way; small, since gRPC holds a stream's first message before its Put "
        "header can be refused (clients send 1 MiB chunks)"))
    stream_window_bytes: int = field(default=256 << 10, metadata=field_help(
        "the HTTP/2 receive window of each stream, fixed: how much a client may send beyond the "
        "message the servicer is reading, which gRPC buffers outside the upload budget; "
        "0 = gRPC's automatic windows (BDP probing, at least 4 MiB a stream; docs/tuning.md)"))
    chunk_bytes: int = field(default=1 * MiB, metadata=field_help("Get stream chunk size"))
    max_key_bytes: int = field(default=256, metadata=field_help("longest key (UTF-8 bytes)"))
    max_lookup_keys: int = field(default=4096, metadata=field_help("most keys in one Lookup/Delete/Pin"))
    grace_s: float = field(default=5.0, metadata=field_help("graceful-shutdown grace period"))
    io_threads: int = field(default=4, metadata=field_help("threads for LMDB and copies"))
    upload_budget_bytes: int = field(default=0, metadata=field_help(
        "bytes the Puts in progress may reserve together (each its declared size, on its header); "
        "a Put beyond it is refused with RESOURCE_EXHAUSTED; 0 = the entry limit"))
    upload_idle_timeout_s: float = field(default=30.0, metadata=field_help(
        "a Put that sends nothing for this long is ended (DEADLINE_EXCEEDED) and its memory freed"))
    # --- tiers ---------------------------------------------------------------------------
    data_dir: Path = field(default=Path("segcache-data"), metadata=field_help("LMDB directory"))
    entry_key_file: Optional[Path] = field(default=None, metadata=field_help(
        "file holding the mesh's entry secret: when given, a Put must be a sealed entry that opens "
        "under it and whose header names its key (common/engine/pic/seal.py), else INVALID_ARGUMENT; "
        "none = entries are opaque bytes"))
    device_bytes: int = field(default=0, metadata=field_help("tier 0 budget (GPU memory); 0 = off; "
                                                      "used only when CUDA is available"))
    device_index: int = field(default=0, metadata=field_help("CUDA device of tier 0"))
    host_bytes: int = field(default=4 * GiB, metadata=field_help("tier 1 budget (host DRAM); 0 = off"))
    disk_bytes: int = field(default=64 * GiB, metadata=field_help("tier 2 budget (LMDB values)"))
    max_entry_bytes: int = field(default=0, metadata=field_help("largest entry; 0 = the smallest "
                                                         "enabled host/disk budget"))
    policy: str = field(default="gdsf", metadata=field_help("eviction policy: gdsf | lru"))
    # --- persistence -----------------------------------------------------------------------
    write_through: bool = field(default=True, metadata=field_help(
        "acknowledge a Put only once it is committed to LMDB; --no-write-through acknowledges "
        "from memory and writes LMDB behind (an acknowledged entry can then be lost on a crash)"))
    lmdb_sync: bool = field(default=True, metadata=field_help("fsync each LMDB commit (power-loss "
                                                      "safety; a process crash is safe either way)"))
    lmdb_map_bytes: int = field(default=0, metadata=field_help("LMDB map size; 0 = derived from disk_bytes"))
    # --- NIXL ----------------------------------------------------------------------------
    nixl: bool = field(default=True, metadata=field_help("offer the NIXL path when nixl imports"))
    nixl_backend: str = field(default="UCX", metadata=field_help("NIXL backend"))
    lease_ttl_s: float = field(default=30.0, metadata=field_help("a NIXL lease ends by itself after this"))

    # --- authorisation (docs/security.md) ---------------------------------------------------
    write_token: Optional[str] = write_token_field(
        "Put/Delete/Pin need this in x-hypic-write-token unless the client certificate is a writer's")
    writer_names: str = field(default="scatter,combine", metadata=field_help(
        "client certificate common names with the writer role (comma list; mutual TLS)"))
    # --- the shared remote tier (docs/segcache.md) ---------------------------------------
    remote_url: str = field(default="", metadata=field_help(
        "shared remote tier below LMDB: mooncake://MASTER_HOST:RPC_PORT (Mooncake Store); "
        "empty = off"))
    remote_queue_entries: int = field(default=256, metadata=field_help(
        "write-behind queue to the remote tier; a full queue drops the write (counted)"))
    remote_segment_bytes: int = field(default=256 * MiB, metadata=field_help(
        "memory this segcache contributes to the Mooncake Store"))
    remote_buffer_bytes: int = field(default=64 * MiB, metadata=field_help(
        "the Mooncake client's transfer buffer: every object put or got passes through it, so an "
        "entry larger than this (plus a small header) is never written to or read from the tier"))

    def __post_init__(self) -> None:
        self.check_server()
        self.data_dir = Path(self.data_dir)
        self.policy = self.policy.lower()
        if self.policy not in ("gdsf", "lru"):
            raise ValueError(f"policy must be gdsf or lru, not {self.policy!r}")
        for name in ("device_bytes", "host_bytes", "disk_bytes", "max_entry_bytes", "lmdb_map_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.disk_bytes <= 0:
            raise ValueError("disk_bytes must be > 0 (LMDB is the persistent tier)")
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        # A chunk plus protobuf framing must fit in one message.
        self.chunk_bytes = min(self.chunk_bytes, self.max_message_bytes - 4096)
        if not 1 <= self.max_key_bytes <= 511:  # LMDB's key limit is 511 bytes
            raise ValueError("max_key_bytes must be in 1..511")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")
        if not 0 <= self.stream_window_bytes < 1 << 31:  # HTTP/2's largest window
            raise ValueError("stream_window_bytes must be in 0..2 GiB - 1")
        if self.upload_budget_bytes < 0:
            raise ValueError("upload_budget_bytes must be >= 0")
        if not (self.upload_idle_timeout_s > 0 and math.isfinite(self.upload_idle_timeout_s)):
            raise ValueError("upload_idle_timeout_s must be > 0")
        if not (self.lease_ttl_s > 0 and math.isfinite(self.lease_ttl_s)):
            raise ValueError("lease_ttl_s must be > 0")
        self.remote_url = (self.remote_url or "").strip()
        if self.remote_url:
            parse_remote_url(self.remote_url)  # ValueError: a clear startup error (exit 2)
        self.advertise_host = (self.advertise_host or "").strip()
        if self.advertise_host and self.advertise_host in WILDCARDS:
            raise ValueError(f"advertise_host {self.advertise_host!r} is a wildcard; peers need a "
                             "reachable name or IP")
        if self.remote_url and not self.advertise_host and self.host.strip() in WILDCARDS:
            raise ValueError(f"advertise_host is needed with remote_url when host is {self.host!r}: "
                             "Mooncake peers would dial that address; set --advertise-host (or "
                             "HYPIC_SEGCACHE_ADVERTISE_HOST) to a name or IP they can reach")
        if self.remote_queue_entries < 1 or self.remote_segment_bytes < MiB \
                or self.remote_buffer_bytes < MiB:
            raise ValueError("remote_queue_entries must be >= 1, remote_segment_bytes and "
                             "remote_buffer_bytes >= 1 MiB")

    @property
    def remote_local_host(self) -> str:
        """The address this segcache gives Mooncake as its own (peers dial it)."""
        return self.advertise_host or self.host

    @property
    def entry_limit(self) -> int:
        """The largest entry accepted: it must fit the disk tier and, when on, the host tier."""
        limits = [self.disk_bytes]
        if self.host_bytes > 0:
            limits.append(self.host_bytes)
        if self.max_entry_bytes > 0:
            limits.append(self.max_entry_bytes)
        return min(limits)

    @property
    def upload_budget(self) -> int:
        """Bytes all Puts in progress may hold together."""
        return self.upload_budget_bytes or self.entry_limit

    @property
    def map_size(self) -> int:
        """LMDB map size: room for the budget plus page rounding, metadata and free pages."""
        if self.lmdb_map_bytes:
            return self.lmdb_map_bytes
        return max(2 * self.disk_bytes, self.disk_bytes + 256 * MiB)
