"""segcache members found by DNS under load: three segcache processes on 127.0.0.{2,3,4} share one
port behind the name `segcache.test` of the loopback DNS server (tests/support/dns_server.py);
router, scatter and combine are all given `dns://…/segcache.test:P`. While 8 clients stream
requests, a member is added (its record appears), then one is removed (its record goes; the
process keeps running, as a pod being drained does). Keys re-home by rendezvous hashing: those
whose owner changed miss once and are rebuilt on their new owner. Every answer is compared with
a reference computed by the in-process engine: 0 wrong, 0 failed; afterwards a repeated prompt is
all hits on the members that remain, and the added member holds entries."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import hypic
from common.engine.hybrid_engine import HybridEngine
from common.mesh.segcache_client import SegcacheClient
from hypic.launcher import Service
from tests.mesh.test_discovery import free_port_on
from tests.support.dns_server import LoopbackDNS
from tests.support.tiny import PIC_CONFIGS, save_tiny
from tests.system.test_replica_failover import CLIENTS, SEAM, Load, prompts

pytestmark = [pytest.mark.timeout(900), pytest.mark.processes]
IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
NAME = "segcache.test"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=13,
                     **PIC_CONFIGS["qwen3_5_text"])


class DnsSegcacheMesh:
    """The three segcache members, one scatter, one combine and a router, on loopback."""

    def __init__(self, model: Path, root: Path, dns: LoopbackDNS):
        self.model, self.root, self.dns = model, root, dns
        self.port = free_port_on(IPS)
        self.services: list[Service] = []

    def service(self, name: str, kind: str, args: list[str], host="127.0.0.1", port=0) -> Service:
        svc = Service(name=name, kind=kind, args=args, run_dir=self.root / "run",
                      log_dir=self.root / "logs", host=host, port=port)
        self.services.append(svc)
        svc.start()
        return svc

    def start(self) -> "DnsSegcacheMesh":
        deadline = time.monotonic() + 300
        segcaches = [self.service(f"segcache{i}", "segcache", ["--data-dir", str(self.root / f"s{i}")],
                                  host=ip, port=self.port) for i, ip in enumerate(IPS)]
        self.dns.set(NAME, IPS[:2])
        target = self.dns.target(NAME, self.port)
        worker = ["--model", str(self.model), "--threads", "1", "--segcache-address", target]
        workers = [self.service("scatter", "scatter", worker), self.service("combine", "combine", worker)]
        for s in segcaches + workers:
            s.wait_ready(deadline)
        self.router = self.service("router", "router", [
            "--model", str(self.model), "--seam", str(SEAM), "--segcache-address", target,
            "--scatter-addresses", workers[0].address, "--combine-addresses", workers[1].address,
            "--discovery-refresh-s", "0.3"])
        self.router.wait_ready(deadline)
        return self

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop(grace_s=5)


async def _entries(address: str) -> int:
    async with SegcacheClient(address, timeout_s=10.0) as c:
        return (await c.stats()).entries


def test_members_join_and_leave_under_load(model, tmp_path, fresh_seed) -> None:
    engine = HybridEngine.from_pretrained(model)
    work = prompts(engine, fresh_seed, 12)
    del engine
    with LoopbackDNS() as dns:
        mesh = DnsSegcacheMesh(model, tmp_path, dns)
        try:
            mesh.start()
            report = []
            with Load(mesh.router.address, work, fresh_seed) as load:
                for phase, members in (("warm", IPS[:2]), ("join", IPS), ("leave", IPS[1:]),
                                       ("after", IPS[1:])):
                    load.phase = phase
                    dns.set(NAME, members)
                    before, t0 = load.served(), time.monotonic()
                    # a few seconds (every process re-resolves) and 3 answers per client
                    while load.served() - before < 3 * CLIENTS or time.monotonic() - t0 < 5:
                        assert time.monotonic() - t0 < 240, (phase, load.errors[-5:])
                        time.sleep(0.1)
                    report.append((phase, round(time.monotonic() - t0, 1)))
            print("\nper phase: ok", dict(load.ok), "failed", dict(load.failed), "wrong",
                  dict(load.wrong), "seconds per phase", report)
            assert sum(load.wrong.values()) == 0
            assert sum(load.failed.values()) == 0, load.errors[:10]
            assert all(load.ok[p] > 0 for p in ("warm", "join", "leave", "after")), dict(load.ok)

            # The members now (127.0.0.3 and .4) hold every entry of a prompt once it was asked:
            # a repeated prompt is all hits, and the member that joined holds its share.
            with hypic.Client(mesh.router.address, timeout=120) as c:
                for segs, query, ref in work[:4]:
                    assert c.generate(segments=segs, query=query, max_tokens=3, stream=False).tokens == ref
                    again = c.generate(segments=segs, query=query, max_tokens=3, stream=False)
                    assert again.tokens == ref and again.timings.hits == len(segs), again.timings
            assert asyncio.run(_entries(f"{IPS[2]}:{mesh.port}")) > 0
        finally:
            mesh.stop()
