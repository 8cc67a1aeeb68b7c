"""Router addresses for the SDK: one channel over every router replica, balanced by gRPC.

`address` is `host:port`, a list `ip:port,ip:port` (IP literals: gRPC's `ipv4:`/`ipv6:`
target), or a DNS name standing for every replica, `dns:///router:50051` (gRPC resolves and
re-resolves it; `dns://SERVER:PORT/name:port` asks that DNS server). The service config turns
on gRPC's round_robin over the members, client-side health checks (grpc.health.v1: a router
that is not SERVING leaves the pick set) and retries of UNAVAILABLE — gRPC only retries a call
before any response arrived, i.e. before the first token, so a retried request is never
answered twice.
"""

from __future__ import annotations

import ipaddress
import json
import re

ROUTER_SERVICE = "hypic.v1.Router"

RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}

SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": ROUTER_SERVICE},
    "methodConfig": [{"name": [{"service": ROUTER_SERVICE}], "retryPolicy": RETRY_POLICY}],
}


def balancing_options() -> list[tuple[str, object]]:
    """Channel options: the service config above, retries on."""
    return [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]


def _host(address: str) -> str:
    m = re.match(r"^\[([^\]]+)\]:\d+$", address) or re.match(r"^([^:\[\]]+):\d+$", address)
    if not m:
        raise ValueError(f"router address {address!r} is not host:port")
    return m.group(1)


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def channel_target(address: str) -> str:
    """The gRPC target for `address` (see the module doc); ValueError when malformed."""
    text = (address or "").strip()
    if text.startswith("dns:"):
        if not re.match(r"^dns://[^/]*/[^/:]+:\d+$", text):
            raise ValueError(f"malformed DNS target {text!r}: expected dns:///name:port")
        return text
    members = [a.strip() for a in text.split(",") if a.strip()]
    if not members:
        raise ValueError("no router address")
    if len(members) == 1:
        _host(members[0])
        return members[0]
    versions = {_ip_version(_host(a)) for a in members}
    if None in versions:
        raise ValueError(f"{text!r}: several router addresses must be IP literals; for host "
                         f"names use one dns:///name:port")
    if len(versions) > 1:
        raise ValueError(f"{text!r}: mixes IPv4 and IPv6 addresses")
    return ("ipv6:" if versions == {6} else "ipv4:") + ",".join(members)
