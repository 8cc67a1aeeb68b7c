"""A real DNS server on 127.0.0.1 for discovery tests (dnslib): UDP and TCP on one port,
answering A/AAAA from a mutable table {name: [ip, ...]}; unknown names get NXDOMAIN."""

from __future__ import annotations

import ipaddress
import threading

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class TableResolver(BaseResolver):
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()
        self.queries = 0

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        qtype = QTYPE[request.q.qtype]
        with self.lock:
            self.queries += 1
            ips = self.records.get(name)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for ip in ips:
            v = ipaddress.ip_address(ip).version
            if qtype == "A" and v == 4:
                reply.add_answer(RR(name, QTYPE.A, rdata=A(ip), ttl=1))
            elif qtype == "AAAA" and v == 6:
                reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(ip), ttl=1))
        return reply


class LoopbackDNS:
    """with LoopbackDNS() as dns: dns.set("scatter.test", ["127.0.0.2"]); dns.port"""

    def __init__(self) -> None:
        self.resolver = TableResolver()
        quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)
        self.tcp = DNSServer(self.resolver, address="127.0.0.1", port=0, tcp=True, logger=quiet)
        self.port = self.tcp.server.server_address[1]
        self.udp = DNSServer(self.resolver, address="127.0.0.1", port=self.port, logger=quiet)

    def set(self, name: str, ips: list[str]) -> None:
        with self.resolver.lock:
            self.resolver.records[name.lower()] = list(ips)

    def remove(self, name: str) -> None:
        with self.resolver.lock:
            self.resolver.records.pop(name.lower(), None)

    def target(self, name: str, port: int) -> str:
        """The gRPC-style target naming this server: dns://127.0.0.1:P/name:port."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def __enter__(self) -> "LoopbackDNS":
        self.tcp.start_thread()
        self.udp.start_thread()
        return self

    def __exit__(self, *exc) -> None:
        self.udp.stop()
        self.tcp.stop()
