"""Where NIXL's UCX backend listens: on the interface of the address the service was told to bind.

nixl's agent config has no listen address (its own listener thread is off; metadata travels in our
gRPC messages), but UCX's TCP transport opens a listening socket on every network device it uses,
the machine's external interface included (measured: 127.0.0.1 and the eth0 address with the
defaults). UCX_NET_DEVICES limits it; this sets it from the service's --host before the first
agent is created:

    127.0.0.1 / localhost / ::1  ->  UCX_NET_DEVICES=lo
    an address of interface X    ->  UCX_NET_DEVICES=X
    0.0.0.0 / ::                 ->  left alone (every interface, as configured)

An operator's own UCX_NET_DEVICES wins. A host that matches no interface also gets "lo": never
listen more widely than asked. Shared-memory transports (cma, shm) are not network devices and
are unaffected.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

UCX_NET_DEVICES = "UCX_NET_DEVICES"
LOOPBACK_DEVICE = "lo"
_SIOCGIFADDR = 0x8915


def _interface_ipv4(name: str) -> str | None:
    """The IPv4 address of interface `name` (Linux ioctl), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _interface_ipv6(name: str) -> set[str]:
    out: set[str] = set()
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == name:
                    out.add(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    except OSError:
        pass
    return out


def _resolve(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        pass
    try:
        return {str(ipaddress.ip_address(ai[4][0])) for ai in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return set()


def devices_for_host(host: str) -> str | None:
    """The UCX_NET_DEVICES value that keeps UCX's listeners on `host`'s interface; None for a
    wildcard host (every interface)."""
    h = host.strip().strip("[]")
    if h in ("", "0.0.0.0", "::"):
        return None
    addresses = _resolve(h)
    if not addresses or all(ipaddress.ip_address(a).is_loopback for a in addresses):
        return LOOPBACK_DEVICE
    for _, name in socket.if_nameindex():
        mine = _interface_ipv6(name)
        v4 = _interface_ipv4(name)
        if v4:
            mine.add(v4)
        if mine & addresses:
            return name
    return LOOPBACK_DEVICE


def restrict_nixl_to_host(host: str) -> str | None:
    """Set UCX_NET_DEVICES for `host` unless the environment already has it; the value in force."""
    if UCX_NET_DEVICES not in os.environ:
        devices = devices_for_host(host)
        if devices is not None:
            os.environ[UCX_NET_DEVICES] = devices
    return os.environ.get(UCX_NET_DEVICES)
