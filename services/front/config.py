"""FrontConfig: every knob of the OpenAI-compatible front.

Flags are `--field-name`, environment variables `HYPIC_FRONTEND_FIELD_NAME`; flag > env > default
(common.mesh.config). `--router-addresses` is comma-separated; requests go round-robin, the next
router when one is unreachable.

TLS (docs/security.md), the fields every service has (common.mesh.tls.TlsConfig, shared
`HYPIC_TLS_*` variables): `--tls-cert/--tls-key` is the front's certificate, presented to the
routers (a mutual-TLS client, as any mesh member) and, with `--https`, served to HTTP clients;
`--tls-ca` verifies the routers and, with `--https`, the HTTP clients' certificates (required
unless `--no-tls-require-client-cert`). `--router-tls-ca` overrides the CA for the routers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common.engine import modes
from common.mesh.config import OTLP_HELP
from common.mesh.fields import field_help
from common.mesh.tls import TlsConfig

ENV_PREFIX = "HYPIC_FRONTEND_"
MODE_NAMES = (*modes.MODES, *modes.ALIASES)  # canonical names, and "naive" (additive's old name)



@dataclass
class FrontConfig(TlsConfig):
    """OpenAI-compatible HTTP front of the Hypic routers."""

    # --- model ---------------------------------------------------------------------------
    model: Path = field(default=Path("models/hypic-tiny-qwen35"), metadata=field_help(
        "model directory the routers serve (its tokenizer and tokenizer_config.json chat template)"))
    served_model_name: str = field(default="", metadata=field_help(
        "the model id clients send; empty = the model directory's name"))
    # --- network -------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=field_help("address to bind"))
    port: int = field(default=8000, metadata=field_help("HTTP port; 0 = ephemeral"))
    port_file: Optional[Path] = field(default=None, metadata=field_help(
        "write {port, pid} as JSON here once serving"))
    router_addresses: str = field(default="127.0.0.1:50051", metadata=field_help(
        "router host:port list, comma-separated"))
    api_key: str = field(default="", metadata=field_help(
        "when set, every /v1 request needs 'Authorization: Bearer <key>' (else 401)"))
    https: bool = field(default=False, metadata=field_help(
        "serve HTTPS with --tls-cert/--tls-key (clients then need a certificate signed by --tls-ca "
        "when one is given, unless --no-tls-require-client-cert)"))
    router_tls_ca: Optional[Path] = field(default=None, metadata=field_help(
        "PEM CA that signed the routers' certificate (default: --tls-ca): reach them over TLS "
        "(neither: plaintext)"))
    router_api_key: str = field(default="", metadata=field_help(
        "bearer token the routers require (their --api-key; '@FILE' reads it from a file)"))
    # --- request handling ----------------------------------------------------------------
    segment_separator: str = field(default=" # # ", metadata=field_help(
        "LMCache-style separator: a completions prompt is split on it into segments, the last "
        "piece being the query; empty = off"))
    default_mode: str = field(default="hypic", metadata=field_help(
        "prefill mode when a request names none: hypic | full | prefix | additive (naive: its old name)"))
    default_max_tokens: int = field(default=128, metadata=field_help(
        "max_tokens when a request gives none"))
    max_in_flight: int = field(default=256, metadata=field_help("requests in flight before 429"))
    request_timeout_s: float = field(default=300.0, metadata=field_help("deadline of one generation"))
    grace_s: float = field(default=5.0, metadata=field_help("graceful-shutdown grace period"))
    # --- observability -------------------------------------------------------------------
    log_level: str = field(default="info", metadata=field_help("debug | info | warning | error"))
    log_json: bool = field(default=True, metadata=field_help("JSON log lines (else console format)"))
    access_log: bool = field(default=True, metadata=field_help(
        "one log line per HTTP request (uvicorn's access log, rendered like every other line)"))
    otlp_endpoint: str = field(default="", metadata=field_help(OTLP_HELP, shared_env=True))

    def __post_init__(self) -> None:
        self.check_tls()
        if self.https and not self.tls_on:
            raise ValueError("--https needs --tls-cert and --tls-key")
        if self.router_tls_ca is not None:
            self.router_tls_ca = Path(self.router_tls_ca)
        self.model = Path(self.model)
        if self.port_file is not None:
            self.port_file = Path(self.port_file)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if not self.routers:
            raise ValueError("at least one router address is needed (--router-addresses)")
        self.default_mode = self.default_mode.lower()
        if self.default_mode not in MODE_NAMES:
            raise ValueError(f"default_mode must be one of {', '.join(MODE_NAMES)}")
        for name in ("default_max_tokens", "max_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("request_timeout_s", "grace_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0")

    @property
    def routers(self) -> list[str]:
        return [a.strip() for a in (self.router_addresses or "").split(",") if a.strip()]

    @property
    def routers_ca(self) -> Optional[Path]:
        """The CA the routers' certificates are checked against (None: plaintext to them)."""
        return self.router_tls_ca or self.tls_ca

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name
