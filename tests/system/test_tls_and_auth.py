"""Transport security (mutual TLS) and authorisation (roles, API key, write token), on real processes.

A mesh started with mutual TLS (a throwaway CA from hypic/certs.py) and a router API key answers
like the in-process engine and stores its entries (scatter's and combine's certificates carry
the writer role); a reader's Put, a Put without a client certificate, a plaintext client and a
request without the API key are refused with clean statuses; NIXL (UCX) and every gRPC port
listen only on loopback. A segcache without TLS takes writes only with its write token."""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import random
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hypic
from common.engine.hybrid_engine import HybridEngine
from common.mesh.auth import bearer_ok, read_secret
from common.mesh.config import describe, load_config
from common.mesh.nixl_listen import devices_for_host
from common.mesh.segcache_client import SegcacheClient
from common.mesh.channels import channel_options, open_channel
from hypic.certs import generate_mesh_certs
from hypic.launcher import Mesh, Service
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from services.router.config import ENV_PREFIX as ROUTER_ENV, RouterConfig
from services.segcache.config import ENV_PREFIX as SEGCACHE_ENV, SegcacheConfig
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEAM = 8
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=7, **PIC_CONFIGS["qwen3_5_text"])


@pytest.fixture(scope="module")
def api_key() -> str:
    return os.urandom(12).hex()


@pytest.fixture(scope="module")
def mesh(model, api_key, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    key_file = data / "api-key"
    key_file.write_text(api_key + "\n")  # a mounted secret: read with @FILE, newline stripped
    with Mesh(model, data, n_scatter=1, threads=1, seam=SEAM, start_timeout_s=180, tls=True,
              extra_args={"router": ["--api-key", f"@{key_file}"]}) as m:
        yield m


def peer(mesh: Mesh, name: str | None) -> SimpleNamespace:
    """TLS settings of a client holding `name`'s certificate (None: only the CA, no certificate)."""
    c = mesh.certs
    return SimpleNamespace(tls_ca=c.ca, tls_cert=c.cert(name) if name else None,
                           tls_key=c.key(name) if name else None)


def segcache_as(mesh: Mesh, name: str | None, *, plaintext: bool = False, **kw) -> SegcacheClient:
    addr = mesh.segcache_address
    ch = open_channel(addr, channel_options(8 << 20), None if plaintext else peer(mesh, name))
    return SegcacheClient(addr, channel=ch, timeout_s=10, **kw)


async def rpc_code(coro) -> Code:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def random_entry(seed: int) -> tuple[str, bytes]:
    g = random.Random(seed)
    return f"test-{seed}-{g.getrandbits(64):x}", g.randbytes(4096)


# ---- the secured mesh answers -----------------------------------------------------------------

@pytest.mark.processes
def test_mtls_mesh_answers_like_the_engine_and_stores_entries(mesh, model, api_key, fresh_seed):
    g = random.Random(fresh_seed)
    segs = [[g.randrange(1, 500) for _ in range(n)] for n in (37, 12, 50)]
    query = [g.randrange(1, 500) for _ in range(5)]
    engine = HybridEngine.from_pretrained(model)
    out = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    want = engine.generate(out, max_new_tokens=6)
    creds = dataclasses.replace(mesh.client_credentials, api_key=api_key)
    with hypic.Client(mesh.router_address, timeout=120, credentials=creds) as c:
        cold = c.generate(segments=segs, query=query, max_tokens=6, stream=False)
        warm = c.generate(segments=segs, query=query, max_tokens=6, stream=False)
    assert cold.tokens == want and warm.tokens == want
    # The workers' Puts went through under mutual TLS: the second request is all hits.
    assert cold.timings.misses == len(segs)
    assert warm.timings.hits == len(segs) and warm.timings.misses == 0


@pytest.mark.processes
def test_router_needs_the_api_key_but_health_does_not(mesh, api_key):
    creds = mesh.client_credentials
    with creds.open(mesh.router_address, [], aio=False) as ch:
        stub = router_grpc.RouterStub(ch)
        for md in ([], [("authorization", "Bearer wrong")], [("authorization", api_key)]):
            with pytest.raises(grpc.RpcError) as ei:
                stub.Info(router_pb.InfoRequest(), timeout=10, metadata=md)
            assert ei.value.code() == Code.UNAUTHENTICATED, md
        ok = stub.Info(router_pb.InfoRequest(), timeout=10, metadata=[("authorization", f"Bearer {api_key}")])
        assert ok.model_fingerprint
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with hypic.Client(mesh.router_address, timeout=10, credentials=creds) as c:  # the SDK, no key
        with pytest.raises(hypic.errors.Unauthenticated):
            c.info()


@pytest.mark.processes
def test_router_refuses_plaintext_and_unknown_cas(mesh, api_key, tmp_path):
    other = generate_mesh_certs(tmp_path / "other-ca", names=["client"])
    md = [("authorization", f"Bearer {api_key}")]
    for ch in (grpc.insecure_channel(mesh.router_address),
               grpc.secure_channel(mesh.router_address, grpc.ssl_channel_credentials(
                   other.ca.read_bytes(), other.key("client").read_bytes(),
                   other.cert("client").read_bytes()))):
        with ch, pytest.raises(grpc.RpcError) as ei:
            router_grpc.RouterStub(ch).Info(router_pb.InfoRequest(), timeout=5, metadata=md)
        assert ei.value.code() == Code.UNAVAILABLE


# ---- segcache: reads for the mesh, writes for the writer role --------------------------------------

@pytest.mark.processes
def test_segcache_writes_need_the_writer_role(mesh, fresh_seed):
    from common.engine.pic.seal import load_secret, seal
    from tests.support.fake_entries import fake_entry, key_of

    # a Put must also be a sealed entry for its key (the mesh's entry key): the writer's one is
    g = random.Random(fresh_seed)
    ids = [g.randrange(50_000) for _ in range(40)]
    key, data = key_of(ids), seal(fake_entry(ids, g.randbytes(4096)), load_secret(mesh.entry_key_file))

    async def main() -> None:
        reader = segcache_as(mesh, "client")       # a mesh member without the writer role
        router = segcache_as(mesh, "router")
        no_cert = segcache_as(mesh, None)          # TLS, but no client certificate
        plain = segcache_as(mesh, None, plaintext=True)
        writer = segcache_as(mesh, "scatter")
        try:
            for c in (reader, router):
                assert await rpc_code(c.put(key, data)) == Code.PERMISSION_DENIED
                assert await rpc_code(c.delete([key])) == Code.PERMISSION_DENIED
                assert await rpc_code(c.pin([key])) == Code.PERMISSION_DENIED
            for c in (no_cert, plain):
                assert await rpc_code(c.put(key, data)) == Code.UNAVAILABLE
                assert await rpc_code(c.lookup([key])) == Code.UNAVAILABLE
            assert (await reader.lookup([key]))[0].tier == 0  # refused writes stored nothing
            assert (await writer.put(key, data)).created
            assert (await reader.lookup([key]))[0].tier != 0  # reads are the mesh's
            assert bytes(await reader.get(key)) == data
            assert await rpc_code(reader.delete([key])) == Code.PERMISSION_DENIED
            assert await writer.delete([key]) == 1
        finally:
            for c in (reader, router, no_cert, plain, writer):
                await c.close()

    asyncio.run(main())


@pytest.fixture
def token_segcache(tmp_path):
    """A lone segcache without TLS whose writes need a write token (from the mesh-wide env)."""
    token = os.urandom(16).hex()
    svc = Service(name="segcache", kind="segcache", run_dir=tmp_path / "run", log_dir=tmp_path / "logs",
                  args=["--data-dir", str(tmp_path / "seg"), "--host-bytes", "64MiB",
                        "--disk-bytes", "256MiB", "--no-nixl"],
                  env={"HYPIC_WRITE_TOKEN": token})
    svc.start()
    try:
        svc.wait_ready(time.monotonic() + 60)
        yield svc, token
    finally:
        svc.stop(10)


@pytest.mark.processes
def test_write_token_without_tls(token_segcache, fresh_seed):
    svc, token = token_segcache
    key, data = random_entry(fresh_seed)

    async def main() -> None:
        anon = SegcacheClient(svc.address, timeout_s=10)
        wrong = SegcacheClient(svc.address, timeout_s=10, write_token=token[::-1])
        writer = SegcacheClient(svc.address, timeout_s=10, write_token=token)
        try:
            assert await rpc_code(anon.put(key, data)) == Code.UNAUTHENTICATED
            assert await rpc_code(wrong.put(key, data)) == Code.UNAUTHENTICATED
            assert await rpc_code(anon.delete([key])) == Code.UNAUTHENTICATED
            assert (await writer.put(key, data)).created
            assert bytes(await anon.get(key)) == data  # reads need no token
        finally:
            for c in (anon, wrong, writer):
                await c.close()

    asyncio.run(main())
    assert token not in svc.log()  # the start-up config line redacts it


@pytest.mark.processes
@pytest.mark.parametrize("bad", [["--tls-cert", "none.pem", "--tls-key", "none.key"],
                                 ["--write-token", "@none.token"]])
def test_unreadable_certificate_or_secret_fails_the_start_cleanly(tmp_path, bad):
    args = [str(tmp_path / a) if a.startswith("none") else "@" + str(tmp_path / a[1:]) if a.startswith("@")
            else a for a in bad]
    svc = Service(name="segcache", kind="segcache", run_dir=tmp_path / "run", log_dir=tmp_path / "logs",
                  args=["--data-dir", str(tmp_path / "seg"), *args])
    svc.start()
    assert svc.wait(60) == 1
    assert "cannot load credentials" in svc.log()


# ---- where things listen -----------------------------------------------------------------------------

def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            a = ipaddress.ip_address(socket.inet_ntop(family, raw))
            a = getattr(a, "ipv4_mapped", None) or a  # grpc binds "::ffff:127.0.0.1" dual-stack
            out.append((str(a), int(hexport, 16)))
    return out


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def test_listening_sockets_sees_a_loopback_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening_sockets(os.getpid())


async def nixl_ready(mesh: Mesh) -> bool:
    """Whether segcache's NIXL agent (made in the background once it serves) is up."""
    sc = segcache_as(mesh, "client")
    try:
        return (await sc.nixl_available())[0]
    finally:
        await sc.close()


@pytest.mark.processes
def test_nothing_listens_beyond_loopback(mesh):
    for name, svc in mesh.services.items():
        socks = listening_sockets(svc.pid)
        assert ("127.0.0.1", svc.port) in socks, name
        assert all(is_loopback(a) for a, _ in socks), (name, socks)
    if asyncio.run(nixl_ready(mesh)):  # NIXL's UCX listener is there, on loopback too
        assert len(listening_sockets(mesh["segcache"].pid)) >= 2
        assert '"nixl_net_devices": "lo"' in mesh.log("segcache")
        assert '"nixl_net_devices": "lo"' in mesh.log("combine0")


def test_nixl_devices_follow_the_host():
    assert devices_for_host("127.0.0.1") == "lo"
    assert devices_for_host("localhost") == "lo"
    assert devices_for_host("0.0.0.0") is None
    assert devices_for_host("203.0.113.77") == "lo"  # no interface has it: never wider than asked


# ---- pieces ----------------------------------------------------------------------------------------

def test_bearer_ok_and_secrets_from_files(tmp_path):
    key = os.urandom(8).hex()
    assert bearer_ok(f"Bearer {key}", key) and bearer_ok(f"bearer  {key} ", key)
    for bad in (None, "", key, f"Bearer {key}x", f"Basic {key}", "Bearer "):
        assert not bearer_ok(bad, key), bad
    f = tmp_path / "secret"
    f.write_text(key + "\n")
    assert read_secret(f"@{f}") == key and read_secret(key) == key and read_secret("") is None
    f.write_text("\n")
    with pytest.raises(ValueError):
        read_secret(f"@{f}")


def test_tls_and_secrets_come_from_shared_env_and_are_redacted(tmp_path, model):
    env = {"HYPIC_TLS_CA": "/x/ca.pem", "HYPIC_WRITE_TOKEN": "t0k", "HYPIC_SEGCACHE_TLS_CA": "/y/ca.pem"}
    cfg = load_config(SegcacheConfig, [], env=env, env_prefix=SEGCACHE_ENV)
    assert str(cfg.tls_ca) == "/y/ca.pem"  # the service's own variable wins
    assert cfg.write_token == "t0k"
    assert describe(cfg)["write_token"] == "<redacted>"
    r = load_config(RouterConfig, ["--model", str(model), "--api-key", "k3y"], env={}, env_prefix=ROUTER_ENV)
    assert describe(r)["api_key"] == "<redacted>" and r.api_key == "k3y"
    with pytest.raises(ValueError):
        load_config(SegcacheConfig, ["--tls-cert", "/a.pem"], env={}, env_prefix=SEGCACHE_ENV)


def test_segcache_rpcs_are_writes_unless_listed_as_reads():
    from protos.hypic.v1 import segcache_pb2 as segcache_pb
    from services.segcache.access import READ_METHODS, SERVICE, writer_role_interceptor

    guard = writer_role_interceptor(SimpleNamespace(writer_names="scatter, combine", write_token=None,
                                                    mutual_tls=True))
    assert not guard.open and guard.writer_names == {"scatter", "combine"}
    methods = segcache_pb.DESCRIPTOR.services_by_name["Segcache"].methods_by_name
    assert READ_METHODS <= set(methods), "a listed read is not an RPC"
    for m in ("Put", "Delete", "Pin"):
        assert guard.is_write(f"/{SERVICE}/{m}")
    for m in READ_METHODS:
        assert not guard.is_write(f"/{SERVICE}/{m}")
    assert guard.is_write(f"/{SERVICE}/SomeRpcAddedLater")  # default deny
    assert not guard.is_write("/grpc.health.v1.Health/Check")
