"""Who may call which segcache RPC: reads are the mesh's, everything else needs the writer role
(common/mesh/auth.py). Default deny: an RPC added to the service is a write until listed here."""
from __future__ import annotations

from typing import Any

from common.mesh.auth import WriterRoleInterceptor, read_secret

SERVICE = "hypic.v1.Segcache"
# Claim is the router's (a reader): it writes no entry, only a lease that expires by itself.
READ_METHODS = frozenset({"Lookup", "Get", "Stats", "NixlInfo", "OpenNixlLease", "ReleaseNixlLease",
                          "ReleaseDeviceLease", "Claim"})


def writer_role_interceptor(cfg: Any) -> WriterRoleInterceptor:
    """From the config: writer certificate names, the write token (@FILE read now), mutual TLS."""
    names = [n.strip() for n in cfg.writer_names.split(",") if n.strip()]
    return WriterRoleInterceptor(SERVICE, read_methods=READ_METHODS, writer_names=names,
                                 write_token=read_secret(cfg.write_token), mutual_tls=cfg.mutual_tls)
