"""Address targets and live member sets.

A target is either a static list `host:port,host:port` or a DNS name that stands for many
members: `dns:///scatter:50071` (the system's resolver) or `dns://127.0.0.1:5353/scatter:50071`
(that DNS server; gRPC's own URI form). Every A and AAAA record of the name is a member on the
given port — what docker compose `--scale` and a Kubernetes headless Service give.

MemberSet keeps the member list of one target current: a static list never changes, a DNS name
is re-resolved every `refresh_s` seconds. A name that does not resolve (NXDOMAIN, no records,
server silent) gives an empty set, logged once, never an exception: the caller decides what an
empty set means (the router builds misses on combine without scatters, and answers UNAVAILABLE
without combines). A malformed target is a ValueError at parse time, i.e. at start-up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import structlog

log = structlog.get_logger("discovery")

DNS_PREFIX = "dns:"
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class Target:
    """A parsed address target: `static` members, or a DNS `name` on `port`."""
    text: str
    static: tuple[str, ...] = ()
    name: str = ""
    port: int = 0
    dns_server: Optional[tuple[str, int]] = None   # None: the system's resolver

    @property
    def is_dns(self) -> bool:
        return bool(self.name)


def _split_host_port(text: str, what: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError when malformed."""
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", text) or re.match(r"^([^:\[\]]+):(\d+)$", text)
    if not m:
        raise ValueError(f"{what} {text!r} is not host:port")
    host, port = m.group(1), int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"{what} {text!r}: port out of range")
    if not _is_ip(host) and not _HOST_RE.match(host):
        raise ValueError(f"{what} {text!r}: {host!r} is not a host name or IP address")
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_target(text: str) -> Target:
    """Parse `host:port[,host:port...]`, `dns:///name:port` or `dns://server[:port]/name:port`.
    An empty text is an empty static target. ValueError on anything malformed."""
    text = (text or "").strip()
    if not text.startswith(DNS_PREFIX):
        members = tuple(a.strip() for a in text.split(",") if a.strip())
        for a in members:
            if "://" in a or a.startswith(DNS_PREFIX):
                raise ValueError(f"address {a!r}: a dns: target must be alone, not in a list")
            _split_host_port(a, "address")
        return Target(text=text, static=members)
    m = re.match(r"^dns://([^/]*)/([^/]+)$", text)
    if not m:
        raise ValueError(f"malformed DNS target {text!r}: expected dns:///name:port or "
                         f"dns://server[:port]/name:port")
    authority, rest = m.group(1), m.group(2)
    name, port = _split_host_port(rest, f"DNS target {text!r}: name")
    server = None
    if authority:
        a = (re.match(r"^\[([^\]]+)\](?::(\d+))?$", authority)
             or re.match(r"^([^:\[\]]+)(?::(\d+))?$", authority))
        if not a:
            raise ValueError(f"DNS target {text!r}: malformed server {authority!r}")
        host, sport = a.group(1), int(a.group(2) or 53)
        if not 0 < sport < 65536:
            raise ValueError(f"DNS target {text!r}: server port out of range")
        if not _is_ip(host):
            raise ValueError(f"DNS target {text!r}: the server must be an IP address")
        server = (host, sport)
    return Target(text=text, name=name, port=port, dns_server=server)


async def resolve(target: Target, timeout_s: float = 2.0) -> list[str]:
    """The members of a target now: sorted `ip:port` strings (static ones as given). A name
    without records resolves to []; other resolver errors raise OSError."""
    if not target.is_dns:
        return list(target.static)
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    r = dns.asyncresolver.Resolver(configure=target.dns_server is None)
    if target.dns_server is not None:
        r.nameservers = [target.dns_server[0]]
        r.port = target.dns_server[1]
    r.lifetime = timeout_s
    if _is_ip(target.name):
        return [join_host_port(target.name, target.port)]
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            ans = await r.resolve(target.name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as e:
            raise OSError(f"resolving {target.name} ({rdtype}): {e}") from None
        found.update(rr.address for rr in ans)
    return sorted(join_host_port(h, target.port) for h in found)


Listener = Callable[[list[str]], Optional[Awaitable[None]]]


class MemberSet:
    """The live members of one target; `listener(members)` runs on every change (and once at
    the first resolution)."""

    def __init__(self, target: Target | str, *, refresh_s: float = 2.0,
                 listener: Listener | None = None, what: str = "members"):
        self.target = parse_target(target) if isinstance(target, str) else target
        self.refresh_s = refresh_s
        self.listener = listener
        self.what = what
        self.members: list[str] = list(self.target.static)
        self._resolved = False
        self._failing = False

    @property
    def resolved(self) -> bool:
        """Whether the first resolution has happened (members may still be empty)."""
        return self._resolved

    async def refresh(self) -> list[str]:
        """Resolve once; keep the last good member list when the resolver itself fails (a DNS
        outage must not empty the mesh); a name that has no records is an empty set."""
        try:
            members = await resolve(self.target, timeout_s=max(0.5, min(2.0, self.refresh_s)))
        except OSError as e:
            if not self._failing:
                log.warning("discovery failed; keeping the last members", what=self.what,
                            target=self.target.text, error=str(e), members=self.members)
            self._failing = True
            if self._resolved:
                return self.members
            members = []
        else:
            self._failing = False
        if members != self.members or not self._resolved:
            if not members:
                log.warning("no members", what=self.what, target=self.target.text)
            else:
                log.info("members", what=self.what, target=self.target.text, members=members)
            self.members = members
            self._resolved = True
            if self.listener is not None:
                out = self.listener(list(members))
                if out is not None:
                    await out
        return self.members

    async def run(self) -> None:
        """Re-resolve every refresh_s seconds until cancelled (static targets: once)."""
        while True:
            try:
                await self.refresh()
            except Exception:  # a listener bug must not stop discovery
                log.exception("member refresh failed", what=self.what)
            if not self.target.is_dns or self.refresh_s <= 0:
                return
            await asyncio.sleep(self.refresh_s)
