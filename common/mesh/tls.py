"""TLS and mutual TLS for every service's server and for the channels it opens to its peers.

A service config inherits `TlsConfig` (fields `--tls-cert/--tls-key/--tls-ca`, env
`HYPIC_<SERVICE>_TLS_*` or, shared by the whole mesh, `HYPIC_TLS_*`):

    server_credentials(cfg)   # None: plaintext; else TLS, client certs required when tls_ca is set
    common.mesh.channels.open_channel(target, options, cfg)   # the client side: secure when cfg has a CA

With a CA the channel verifies the server's certificate against it and presents this service's
own certificate (its identity, e.g. CN=scatter, which segcache checks for the writer role).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import grpc

from common.mesh.fields import field_help


def _shared(text: str) -> dict:
    """A field with one value for the whole mesh: the service's own variable, else HYPIC_TLS_*."""
    return field_help(text, shared_env=True)


@dataclass
class TlsConfig:
    """The TLS fields every service config has (a base dataclass: all fields have defaults)."""

    tls_cert: Optional[Path] = field(default=None, metadata=_shared(
        "PEM certificate of this service: served with --tls-key, and presented to peers as its identity"))
    tls_key: Optional[Path] = field(default=None, metadata=_shared("PEM private key of --tls-cert"))
    tls_ca: Optional[Path] = field(default=None, metadata=_shared(
        "PEM CA bundle: peers' certificates are verified against it (mutual TLS)"))
    tls_require_client_cert: bool = field(default=True, metadata=_shared(
        "with --tls-ca, refuse clients without a certificate signed by it"))

    def __post_init__(self) -> None:
        self.check_tls()

    def check_tls(self) -> None:
        """Paths as Paths; --tls-cert and --tls-key together (ValueError otherwise)."""
        for name in ("tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, Path(v))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        # The files are read when the server starts (a missing one fails the start, logged):
        # a config can be checked where the secrets are not mounted (tests/test_compose_file.py).

    @property
    def tls_on(self) -> bool:
        """This service serves TLS (and a client cert is presented to peers)."""
        return self.tls_cert is not None

    @property
    def mutual_tls(self) -> bool:
        """Clients must present a certificate signed by tls_ca."""
        return self.tls_on and self.tls_ca is not None and self.tls_require_client_cert


def read_pem(path: Path | None) -> bytes | None:
    """The bytes of a PEM file, None for no path."""
    return None if path is None else Path(path).read_bytes()


def server_credentials(cfg: Any) -> grpc.ServerCredentials | None:
    """The server side: None when TLS is off (cfg without tls fields counts as off)."""
    if getattr(cfg, "tls_cert", None) is None:
        return None
    return grpc.ssl_server_credentials(
        [(read_pem(cfg.tls_key), read_pem(cfg.tls_cert))], root_certificates=read_pem(cfg.tls_ca),
        require_client_auth=bool(cfg.tls_ca is not None and cfg.tls_require_client_cert))


def server_credentials_kind(cfg: Any) -> str:
    """"off" | "tls" | "mutual": what the service's server demands, for its start-up log line."""
    if getattr(cfg, "tls_cert", None) is None:
        return "off"
    return "mutual" if cfg.mutual_tls else "tls"
