"""The SDK (hypic.Client / AsyncClient / errors / cli) against a real router started by the
launcher (hypic.launcher.Mesh: segcache + router processes). The combine behind the router is a
hung HTTP/2 peer (up, never answers), so every accepted request ends at its deadline; the
generation path itself is covered by the mesh tests once combine and scatter exist."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import hypic
from hypic import errors
from hypic.launcher import Mesh, MeshError
from test_router import HungHttp2, closed_port, make_tiny_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    base = tmp_path_factory.mktemp("sdk")
    model = make_tiny_model(base / "model")
    hung = HungHttp2()
    m = Mesh(model, base / "data", n_scatter=0, n_combine=0, external_combine=[hung.address],
             extra_args={"router": ["--max-in-flight", "1", "--log-level", "debug"],
                         "segcache": ["--host-bytes", "16MiB", "--disk-bytes", "64MiB",
                                      "--no-nixl"]},
             start_timeout_s=120, grace_s=10)
    with m:
        yield m
    hung.close()
    assert not any(s.alive() for s in m.services.values())


def test_mesh_addresses_and_info(mesh) -> None:
    assert set(mesh.addresses) == {"segcache", "router"}
    assert mesh.healthy()
    with hypic.Client(mesh.router_address) as c:
        info = c.info()
    assert info.vocab_size == 512 and info.seam == 8 and info.dtype == "float32"
    assert info.segcache_address == mesh.segcache_address
    assert info.combine_addresses == mesh.combine_addresses
    assert info.model_fingerprint == mesh["router"].info["fingerprint"]


def test_client_side_validation_needs_no_server() -> None:
    c = hypic.Client(f"127.0.0.1:{closed_port()}")
    with pytest.raises(errors.InvalidArgument):
        c.generate(segments=["a"], query="q", mode="bogus")
    with pytest.raises(errors.InvalidArgument):
        c.generate(segments="not a list", query="q")
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
        c.generate(segments=[[1, -2]], query="q")
    c.close()


def test_invalid_argument_sync_and_async(mesh) -> None:
    with hypic.Client(mesh.router_address, timeout=10) as c:
        with pytest.raises(errors.InvalidArgument) as ei:
            c.generate(segments=[], query="q", stream=False)
        assert ei.value.code.name == "INVALID_ARGUMENT" and "no segments" in ei.value.details
        assert ei.value.request_id
        stream = c.generate(segments=["a", [1, 2, 99999]], query="q", stream=True)
        with pytest.raises(errors.InvalidArgument, match="vocabulary"):
            list(stream)
        with pytest.raises(errors.InvalidArgument):
            c.generate(segments=["a"], query="q", max_tokens=0, stream=False)

    async def run() -> None:
        async with hypic.AsyncClient(mesh.router_address, timeout=10) as c:
            with pytest.raises(errors.InvalidArgument):
                await c.generate(segments=[""], query="q", stream=False)
            with pytest.raises(errors.InvalidArgument):
                async for _ in c.generate(segments=["a"], query=[], stream=True):
                    pass
            info = await c.info()
            assert info.vocab_size == 512

    asyncio.run(run())


def test_deadline_exceeded_sync_and_async(mesh) -> None:
    t = time.monotonic()
    with hypic.Client(mesh.router_address) as c:
        with pytest.raises(errors.DeadlineExceeded) as ei:
            c.generate(segments=["alice likes tea"], query="bob", stream=False, timeout=1.0,
                       request_id="sdk-deadline")
    assert isinstance(ei.value, TimeoutError) and ei.value.request_id == "sdk-deadline"
    assert time.monotonic() - t < 3.0

    async def run() -> None:
        async with hypic.AsyncClient(mesh.router_address) as c:
            with pytest.raises(errors.DeadlineExceeded):
                async for _ in c.generate(segments=[[1, 2, 3]], query=[4], timeout=0.8):
                    pass

    asyncio.run(run())


def test_resource_exhausted(mesh) -> None:
    """The router takes one request at a time (--max-in-flight 1): a second one is refused
    while the first hangs; once the first is cancelled, requests are accepted again."""
    c = hypic.Client(mesh.router_address)
    first = c.generate(segments=[[1, 2, 3]], query=[4], stream=True, timeout=60)
    got: list[BaseException] = []

    def consume() -> None:
        try:
            list(first)
        except errors.HypicError as e:
            got.append(e)

    th = threading.Thread(target=consume)
    th.start()
    time.sleep(1.0)
    with pytest.raises(errors.ResourceExhausted):
        c.generate(segments=[[1]], query=[2], stream=False, timeout=5)
    first.cancel()
    th.join(10)
    assert got and isinstance(got[0], errors.Cancelled)
    deadline = time.monotonic() + 5
    while True:
        try:
            c.generate(segments=[[1]], query=[2], stream=False, timeout=0.5)
        except errors.ResourceExhausted:
            assert time.monotonic() < deadline
            time.sleep(0.1)
            continue
        except errors.DeadlineExceeded:
            break
    c.close()


def test_unavailable_kill_and_restart(mesh) -> None:
    addr = mesh.router_address
    mesh.kill("router")
    assert "router" in mesh.dead()
    with hypic.Client(addr, timeout=2) as c:
        with pytest.raises(errors.Unavailable) as ei:
            c.generate(segments=["a"], query="q", stream=False)
        assert isinstance(ei.value, ConnectionError)
        with pytest.raises(errors.Unavailable):
            c.info()
    svc = mesh.restart("router")
    assert svc.restarts == 1 and mesh.router_address == addr and mesh.healthy("router")
    with hypic.Client(addr, timeout=5) as c:
        c.wait_ready(5)
        assert c.info().vocab_size == 512
    with pytest.raises(errors.Unavailable):
        hypic.Client(f"127.0.0.1:{closed_port()}").wait_ready(0.5)


def test_cli_generate_info_health(mesh, capsys) -> None:
    from hypic.cli import main

    assert main(["info", "--address", mesh.router_address]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocab_size"] == 512
    assert main(["health", mesh.router_address]) == 0
    assert main(["health", f"127.0.0.1:{closed_port()}", "--timeout", "0.5"]) == 1
    capsys.readouterr()
    rc = main(["generate", "--address", mesh.router_address, "--segment", "alice likes tea",
               "--segment-ids", "1,2,3", "--query", "bob", "--max-tokens", "2", "--timeout", "1"])
    assert rc == 1 and "DEADLINE_EXCEEDED" in capsys.readouterr().err
    rc = main(["generate", "--address", mesh.router_address, "--query", "bob", "--timeout", "2"])
    assert rc == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err


def test_mesh_reports_a_service_that_cannot_start(tmp_path) -> None:
    m = Mesh(tmp_path / "no-model", tmp_path / "data", n_scatter=0, n_combine=0,
             external_combine=["127.0.0.1:1"], segcache=False)
    with pytest.raises(MeshError, match="no model"):
        m.start()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")  # no vocab_size: the router exits
    m = Mesh(tmp_path / "bad", tmp_path / "data", n_scatter=0, n_combine=0,
             external_combine=["127.0.0.1:1"], segcache=False, start_timeout_s=60)
    with pytest.raises(MeshError, match="exited with status 1"):
        m.start()
    assert m.dead() == ["router"]
