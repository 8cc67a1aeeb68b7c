"""Discovery of peers by name: address targets, DNS member sets against a real DNS server on
127.0.0.1 (tests/support/dns_server.py), and a mesh whose router finds its scatters and combine by
name: a scatter added by a record receives builds, a removed or killed one leaves the plan,
answers stay equal to the in-process engine, bad targets fail fast."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hypic
from common.engine.hybrid_engine import HybridEngine
from common.mesh.config import ConfigError, load_config
from common.mesh.discovery import MemberSet, parse_target, resolve
from tests.support.dns_server import LoopbackDNS
from hypic.launcher import REPO_ROOT, Service
from hypic.targets import channel_target
from services.router.config import RouterConfig
from tests.support.tiny import PIC_CONFIGS, save_tiny

pytestmark = pytest.mark.timeout(600)
SEAM = 8


# ==== targets (pure) ===========================================================================

def test_parse_static_and_dns_targets() -> None:
    t = parse_target(" 127.0.0.1:1, host-a:2 ,[::1]:3")
    assert not t.is_dns and t.static == ("127.0.0.1:1", "host-a:2", "[::1]:3")
    assert parse_target("").static == ()
    d = parse_target("dns:///scatter:50071")
    assert d.is_dns and (d.name, d.port, d.dns_server) == ("scatter", 50071, None)
    d = parse_target("dns://127.0.0.1:5353/scatter.ns.svc:7")
    assert (d.name, d.port, d.dns_server) == ("scatter.ns.svc", 7, ("127.0.0.1", 5353))
    assert parse_target("dns://[::1]/s:7").dns_server == ("::1", 53)


@pytest.mark.parametrize("bad", [
    "dns:///scatter", "dns:///:50071", "dns://scatter:50071", "dns:scatter:1", "dns:///a:0",
    "dns:///a:70000", "dns://dns.example/a:1", "dns:///a:1,dns:///b:2", "a:1,dns:///b:2",
    "host", "host:port", "a b:1", "dns:///a/b:1"])
def test_malformed_targets_are_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_target(bad)
    with pytest.raises(ConfigError, match="scatter_addresses"):
        load_config(RouterConfig, ["--scatter-addresses", bad], env={})


def test_router_config_accepts_dns_combines_without_a_static_list() -> None:
    cfg = load_config(RouterConfig, ["--combine-addresses", "dns:///combine:50081",
                                      "--scatter-addresses", "dns:///scatter:50071"], env={})
    assert cfg.combines == [] and cfg.combine_target.is_dns and cfg.scatter_target.port == 50071
    with pytest.raises(ConfigError, match="discovery_refresh_s"):
        load_config(RouterConfig, ["--discovery-refresh-s", "0"], env={})


def test_sdk_channel_target_for_many_routers() -> None:
    f = channel_target
    assert f("127.0.0.1:1") == "127.0.0.1:1"
    assert f("127.0.0.1:1,127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert f("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    assert f("dns:///router:50051") == "dns:///router:50051"
    for bad in ("a:1,b:2", "127.0.0.1:1,[::1]:2"):
        with pytest.raises(ValueError):
            f(bad)
    for bad in ("dns:///router", "", "router"):
        with pytest.raises(ValueError):
            hypic.Client(bad)


def test_planner_follows_membership(fresh_seed: int) -> None:
    from services.router.planner import Job, Planner

    rng = random.Random(fresh_seed)
    p = Planner(0)
    assert p.up_workers() == []
    with pytest.raises(ValueError):
        p.assign([Job(0, "k0", 10)])
    a, b = p.add_worker(), p.add_worker()
    jobs = [Job(i, f"k{i}-{rng.random()}", rng.randrange(10, 500)) for i in range(8)]
    t = p.assign(jobs)
    assert {x.worker for x in t.assignments} == {a, b}
    p.set_absent(a)                                   # its record went away
    assert p.up_workers() == [b] and not p.idle(a)
    t2 = p.assign([Job(0, f"new-{rng.random()}", 50)])
    assert t2.assignments[0].worker == b
    p.release(t)
    p.release(t2)
    assert p.idle(a) and p.loads() == [0.0, 0.0]
    p.mark_down(b)                                    # present but not answering: still used
    assert p.up_workers() == [b]                      # when it is the only one (combine falls back)
    p.set_absent(a, False)                            # back: clean state
    assert p.up_workers() == [a] and not p.is_down(a)


# ==== member sets against a real DNS server ====================================================

def test_member_set_follows_records(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    ips = sorted({f"127.0.{rng.randrange(256)}.{rng.randrange(1, 255)}" for _ in range(4)})
    port = rng.randrange(1024, 65535)

    async def scenario(dns: LoopbackDNS) -> None:
        seen: list[list[str]] = []
        ms = MemberSet(dns.target("scatter.test", port), refresh_s=0.1, listener=seen.append)
        want = lambda xs: sorted(f"{ip}:{port}" for ip in xs)  # noqa: E731
        dns.set("scatter.test", ips[:2])
        assert await ms.refresh() == want(ips[:2]) and seen == [want(ips[:2])]
        dns.set("scatter.test", ips)                     # a member appears
        assert await ms.refresh() == want(ips)
        dns.set("scatter.test", ips[1:] + ["::1"])       # one leaves, an AAAA joins
        assert await ms.refresh() == sorted(want(ips[1:]) + [f"[::1]:{port}"])
        await ms.refresh()
        assert len(seen) == 3                            # no change, no call
        dns.remove("scatter.test")                       # NXDOMAIN: an empty set, no error
        assert await ms.refresh() == []
        dns.set("scatter.test", ips[:1])
        task = asyncio.create_task(ms.run())             # the loop picks changes up by itself
        t0 = time.monotonic()
        while ms.members != want(ips[:1]):
            assert time.monotonic() - t0 < 3, ms.members
            await asyncio.sleep(0.02)
        task.cancel()

    with LoopbackDNS() as dns:
        asyncio.run(scenario(dns))


def test_silent_dns_server_keeps_members_and_never_hangs() -> None:
    async def scenario() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))                         # a "server" that never answers
        silent = f"dns://127.0.0.1:{s.getsockname()[1]}/scatter.test:1"
        t0 = time.monotonic()
        with pytest.raises(OSError):
            await resolve(parse_target(silent), timeout_s=0.5)
        ms = MemberSet(silent, refresh_s=0.5)
        assert await ms.refresh() == []
        assert time.monotonic() - t0 < 5
        s.close()

    asyncio.run(scenario())


# ==== a mesh found by name ===================================================================

def free_port_on(hosts: list[str]) -> int:
    """A TCP port free on every one of `hosts` (members of one DNS name share the port)."""
    for _ in range(100):
        port = random.randrange(20000, 60000)
        socks = []
        try:
            for h in hosts:
                s = socket.socket()
                socks.append(s)
                s.bind((h, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no common free port")


def docs(seed: int, lengths) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(1, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=7,
                     **PIC_CONFIGS["qwen3_5_text"])


@pytest.fixture(scope="module")
def engine(model) -> HybridEngine:
    return HybridEngine.from_pretrained(model)


class NamedMesh:
    """segcache, scatters on 127.0.0.{2,3,4}:P, a combine on 127.0.0.5:Q and a router, the
    router finding scatters and combine through the loopback DNS server."""
    SCATTER_IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    COMBINE_IP = "127.0.0.5"

    def __init__(self, model: Path, root: Path, dns: LoopbackDNS):
        self.model, self.root, self.dns = model, root, dns
        self.scatter_port = free_port_on(self.SCATTER_IPS)
        self.combine_port = free_port_on([self.COMBINE_IP])
        self.services: dict[str, Service] = {}

    def service(self, name: str, kind: str, args: list[str], host="127.0.0.1", port=0) -> Service:
        svc = Service(name=name, kind=kind, args=args, run_dir=self.root / "run",
                      log_dir=self.root / "logs", host=host, port=port)
        self.services[name] = svc
        svc.start()
        return svc

    @property
    def segcache_target(self) -> str:
        """segcache by name too: a single gRPC channel that gRPC itself resolves."""
        return self.dns.target("segcache.test", self.services["segcache"].port)

    def worker_args(self) -> list[str]:
        return ["--model", str(self.model), "--threads", "1",
                "--segcache-address", self.segcache_target]

    def start_scatter(self, i: int) -> Service:
        return self.service(f"scatter{i}", "scatter", self.worker_args(),
                            host=self.SCATTER_IPS[i], port=self.scatter_port)

    def start(self, n_scatter: int) -> "NamedMesh":
        deadline = time.monotonic() + 300
        self.service("segcache", "segcache", ["--data-dir", str(self.root / "segcache")])
        self.services["segcache"].wait_ready(deadline)
        self.dns.set("segcache.test", ["127.0.0.1"])
        workers = [self.start_scatter(i) for i in range(n_scatter)]
        workers.append(self.service("combine", "combine", self.worker_args(),
                                    host=self.COMBINE_IP, port=self.combine_port))
        for w in workers:
            w.wait_ready(deadline)
        self.dns.set("scatter.test", self.SCATTER_IPS[:n_scatter])
        self.dns.set("combine.test", [self.COMBINE_IP])
        router = self.service("router", "router", [
            "--model", str(self.model), "--seam", str(SEAM),
            "--segcache-address", self.segcache_target,
            "--scatter-addresses", self.dns.target("scatter.test", self.scatter_port),
            "--combine-addresses", self.dns.target("combine.test", self.combine_port),
            "--discovery-refresh-s", "0.3", "--load-poll-s", "0.3"])
        router.wait_ready(deadline)
        self.dns.set("router.test", ["127.0.0.1"])
        return self

    def stop(self) -> None:
        for svc in reversed(list(self.services.values())):
            svc.stop(grace_s=5)

    def scatter_address(self, i: int) -> str:
        return f"{self.SCATTER_IPS[i]}:{self.scatter_port}"


@pytest.fixture(scope="module")
def named_mesh(model, tmp_path_factory):
    with LoopbackDNS() as dns:
        mesh = NamedMesh(model, tmp_path_factory.mktemp("named"), dns)
        try:
            yield mesh.start(n_scatter=2)
        finally:
            mesh.stop()


def wait_members(client: hypic.Client, want: list[str], timeout_s: float = 5.0) -> float:
    """Seconds until the router's Info lists exactly `want` as scatter members."""
    t0 = time.monotonic()
    while sorted(client.info().scatter_addresses) != sorted(want):
        assert time.monotonic() - t0 < timeout_s, client.info().scatter_addresses
        time.sleep(0.05)
    return time.monotonic() - t0


def ask(client: hypic.Client, engine: HybridEngine, seed: int, lengths) -> list:
    """A cold request (fresh random segments) answered equal to the in-process engine;
    returns its trace."""
    segs, query = docs(seed, lengths), [3, 1, 4]
    ref = engine.generate(engine.prefill_segments(segs, query, mode="hypic", seam=SEAM),
                          max_new_tokens=4)
    res = client.generate(segments=segs, query=query, max_tokens=4, stream=False)
    assert res.tokens == ref
    return list(res.timings.trace)


@pytest.mark.processes
def test_router_follows_scatter_records(named_mesh, engine, fresh_seed) -> None:
    mesh, dns = named_mesh, named_mesh.dns
    router = dns.target("router.test", mesh.services["router"].port)   # the SDK by name too
    with hypic.Client(router, timeout=120) as c:
        wait_members(c, [mesh.scatter_address(0), mesh.scatter_address(1)])
        segs, query = docs(fresh_seed, [60] * 6), [3, 1, 4]
        trace = ask(c, engine, fresh_seed, [60] * 6)
        assert {t.worker for t in trace} == {f"scatter@{mesh.scatter_address(i)}" for i in (0, 1)}
        warm = c.generate(segments=segs, query=query, max_tokens=1, stream=False)
        assert warm.timings.hits == 6, "builds were stored in and found from segcache by name"

        # add a scatter by adding a record: used within seconds, and it receives builds
        mesh.start_scatter(2).wait_ready(time.monotonic() + 300)
        dns.set("scatter.test", mesh.SCATTER_IPS)
        joined_s = wait_members(c, [mesh.scatter_address(i) for i in range(3)])
        trace = ask(c, engine, fresh_seed + 1, [60] * 9)
        new = f"scatter@{mesh.scatter_address(2)}"
        assert sum(t.worker == new for t in trace) >= 2, trace

        # remove a record: the (still running) worker leaves the plan
        dns.set("scatter.test", mesh.SCATTER_IPS[1:])
        wait_members(c, [mesh.scatter_address(1), mesh.scatter_address(2)])
        trace = ask(c, engine, fresh_seed + 2, [60] * 6)
        assert f"scatter@{mesh.scatter_address(0)}" not in {t.worker for t in trace}

        # kill one that stays in DNS: the request is still answered, right
        mesh.services["scatter1"].signal(9)
        mesh.services["scatter1"].wait(10)
        ask(c, engine, fresh_seed + 3, [60] * 6)
        time.sleep(1.0)                                   # a load poll marks it down
        trace = ask(c, engine, fresh_seed + 4, [60] * 6)
        assert {t.worker for t in trace} == {new}, trace

        # no record at all: misses are built on combine
        dns.remove("scatter.test")
        wait_members(c, [])
        trace = ask(c, engine, fresh_seed + 5, [60] * 3)
        assert {t.source for t in trace} == {"local"}
    print(f"scatter joined the plan {joined_s:.2f} s after its record")


@pytest.mark.processes
def test_combine_name_without_records_is_unavailable_fast(named_mesh, engine, fresh_seed) -> None:
    mesh, dns = named_mesh, named_mesh.dns
    with hypic.Client(mesh.services["router"].address, timeout=60) as c:
        dns.remove("combine.test")
        time.sleep(1.0)                                   # > discovery_refresh_s
        t0 = time.monotonic()
        with pytest.raises(hypic.errors.Unavailable, match="no combine"):
            c.generate(segments=docs(fresh_seed, [20]), query=[1], max_tokens=1, stream=False)
        assert time.monotonic() - t0 < 10
        dns.set("combine.test", [mesh.COMBINE_IP])
        time.sleep(1.0)
        ask(c, engine, fresh_seed, [30, 20])


@pytest.mark.processes
def test_router_with_a_malformed_target_exits_at_once(model) -> None:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "services.router", "--model", str(model),
                        "--combine-addresses", "dns:///combine"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "combine_addresses" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30
