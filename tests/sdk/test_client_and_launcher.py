"""The SDK (hypic.Client / AsyncClient / errors / cli) and the launcher (hypic.launcher.Mesh),
all against real processes.

- `mesh`: segcache + router started by Mesh; the combine behind the router is a hung HTTP/2 peer
  (up, never answers), so every accepted request ends at its deadline: typed errors, limits,
  kill/restart.
- `full_mesh`: segcache + scatter + combine + router: tokens, timings, hits on the second
  request, cancellation reaching combine. (The lead's end-to-end tests go further: answers equal
  to in-process prefill_segments, kill -9 of a scatter worker, load.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import hypic
from hypic import errors
from hypic.launcher import Mesh, MeshError
from tests.support.peers import HungHttp2, closed_port
from tests.support.tiny import make_tiny_model

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
    assert m.exit_codes and all(c == 0 for c in m.exit_codes.values()), m.exit_codes  # clean SIGTERM exits


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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
    assert main(["up", "--model", str(mesh.data_dir / "no-such-model")]) == 2
    assert "no model" in capsys.readouterr().err


@pytest.mark.processes
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


@pytest.mark.processes
def test_launcher_flags_match_service_configs(tmp_path) -> None:
    """Every flag Mesh starts a service with is a field of that service's config dataclass, and
    the config loads (catches renamed flags before a mesh is started)."""
    from common.mesh.config import load_config
    from tests.support.service_configs import config_flags, service_config

    from hypic.certs import MeshCerts

    for tls in (False, True):  # `hypic up --tls`: every service, the front included, gets TLS flags
        m = Mesh(tmp_path / "model", tmp_path / "data", n_scatter=2, threads=1, tls=tls)
        m.certs = MeshCerts(tmp_path / "tls") if tls else None  # what start() makes
        for kind in ("segcache", "scatter", "combine", "router", "front"):
            args = m.service_args(kind, segcache="127.0.0.1:1", scatter=["127.0.0.1:2"],
                                  combine=["127.0.0.1:3"], router="127.0.0.1:4")
            args = (m.certs.flags(kind) if tls else []) + args
            args += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(tmp_path / "p.json")]
            flags = config_flags(kind)
            assert [a for a in args if a.startswith("--") and a not in flags] == [], (kind, tls)
            cls, prefix = service_config(kind)
            cfg = load_config(cls, args, env={}, env_prefix=prefix)
            assert cfg.tls_on == tls, (kind, tls)
            if kind == "front":
                assert cfg.https == tls and cfg.mutual_tls == tls


# ---- the whole mesh (segcache, scatter, combine, router) -------------------------------------

@pytest.fixture(scope="module")
def full_mesh(tmp_path_factory):
    base = tmp_path_factory.mktemp("full")
    model = make_tiny_model(base / "model")
    with Mesh(model, base / "data", n_scatter=1, threads=1, start_timeout_s=150,
              extra_args={"segcache": ["--host-bytes", "16MiB", "--disk-bytes", "64MiB"]}) as m:
        yield m
    assert m.exit_codes and all(c == 0 for c in m.exit_codes.values()), m.exit_codes  # clean SIGTERM exits


@pytest.mark.processes
def test_generate_end_to_end(full_mesh) -> None:
    """Cold request (misses built by scatter), then the same request warm (segcache hits): the
    same greedy tokens, streamed and not, sync and async; the first token carries logits."""
    segs = ["alice likes tea . bob likes milk .", [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
            "carol likes juice ."]
    with hypic.Client(full_mesh.router_address, timeout=60) as c:
        stream = c.generate(segments=segs, query="carol likes", max_tokens=5, return_logits=True)
        toks = list(stream)
        assert [t.index for t in toks] == list(range(5))
        assert toks[0].logits is not None and len(toks[0].logits) == 512
        assert all(t.logits is None for t in toks[1:])
        cold = stream.timings
        assert stream.done and cold.segments == 3 and cold.misses == 3 and cold.hits == 0
        assert cold.ttft_s > 0 and cold.total_s >= cold.ttft_s and cold.prompt_tokens > 11
        warm = c.generate(segments=segs, query="carol likes", max_tokens=5, stream=False)
        assert warm.tokens == [t.id for t in toks]
        assert warm.text == "".join(t.text for t in toks)
        assert warm.timings.hits == 3 and warm.timings.misses == 0
        assert sum(warm.timings.hits_by_tier.values()) == 3
        full = c.generate(segments=segs, query="carol likes", max_tokens=2, stream=False,
                          mode="full")
        assert len(full.tokens) == 2 and full.timings.hits == 0

    async def run() -> list[int]:
        async with hypic.AsyncClient(full_mesh.router_address, timeout=60) as ac:
            r = await ac.generate(segments=segs, query="carol likes", max_tokens=5, stream=False)
            return r.tokens

    assert asyncio.run(run()) == warm.tokens


@pytest.mark.processes
def test_cancel_propagates_to_combine(full_mesh) -> None:
    """A client that stops reading and cancels ends the combine stream too: combine's in-flight
    count (Combine.Info) drops back to 0 long before its 4000 tokens would have been decoded."""
    import grpc

    from protos.hypic.v1 import combine_pb2 as combine_pb
    from protos.hypic.v1 import combine_pb2_grpc as combine_grpc

    ch = grpc.insecure_channel(full_mesh["combine0"].address)
    combine = combine_grpc.CombineStub(ch)

    def in_flight() -> int:
        return combine.Info(combine_pb.CombineInfoRequest(), timeout=5).in_flight

    rid = "sdk-cancel-1"
    with hypic.Client(full_mesh.router_address, timeout=120) as c:
        stream = c.generate(segments=[[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], query=[1, 2],
                            max_tokens=4000, request_id=rid)
        with stream:  # leaving the block cancels the call
            for tok in stream:
                if tok.index == 3:
                    assert in_flight() == 1
                    break
        t = time.monotonic()
        while in_flight() != 0:
            assert time.monotonic() - t < 3.0, "combine still runs the cancelled request"
            time.sleep(0.05)
    ch.close()
    router_lines = [json.loads(x) for x in full_mesh.log("router").splitlines() if x.startswith("{")]
    assert any(d.get("request_id") == rid and d.get("event") == "request cancelled"
               for d in router_lines)


@pytest.mark.processes
def test_result_says_how_each_request_was_served(full_mesh) -> None:
    """Served (result.served, stream.served): segments reused, built and recomputed, the seam,
    the mode and the shadow flag, per request and mode, on a real mesh; the first Timings (right
    after the first token) already says it, read without taking a second token."""
    segs = [[21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31], "dave likes coffee .", [40, 41, 42, 43, 44]]
    with hypic.Client(full_mesh.router_address, timeout=60) as c:
        stream = c.generate(segments=segs, query="dave likes", max_tokens=6)
        first = next(stream)
        early = stream.read_timings()
        assert early is not None and stream.tokens == [first.id]  # no token read ahead
        assert stream.served == hypic.Served(reused=0, built=3, recomputed=0, seam=8, mode="hypic",
                                             shadowed=False)
        rest = list(stream)
        assert [t.index for t in rest] == list(range(1, len(rest) + 1))  # nothing lost or repeated
        assert stream.tokens == [first.id] + [t.id for t in rest]
        assert stream.timings.served == early.served and stream.timings.total_s >= early.total_s

        def served(mode: str, segments=segs) -> hypic.Served:
            r = c.generate(segments=segments, query="dave likes", max_tokens=2, stream=False, mode=mode)
            assert r.served == r.timings.served and r.timings.served_mode == mode
            return r.served

        assert served("hypic") == hypic.Served(3, 0, 0, 8, "hypic", False)   # warm: all reused
        assert served("full") == hypic.Served(0, 0, 3, 0, "full", False)
        assert served("additive") == hypic.Served(0, 3, 0, 0, "additive", False)  # seam-0 entries
        assert served("additive") == hypic.Served(3, 0, 0, 0, "additive", False)
        assert served("prefix") == hypic.Served(0, 0, 3, 0, "prefix", False)  # cold prefix cache
        assert served("prefix") == hypic.Served(3, 0, 0, 0, "prefix", False)  # combine's prefix cache
        longer = segs + ["erin likes tea ."]
        assert served("prefix", longer) == hypic.Served(3, 0, 1, 0, "prefix", False)
        assert served("hypic", longer) == hypic.Served(3, 1, 0, 8, "hypic", False)

    async def run() -> hypic.Served | None:
        async with hypic.AsyncClient(full_mesh.router_address, timeout=60) as ac:
            s = ac.generate(segments=segs, query="dave likes", max_tokens=4)
            await s.__anext__()
            assert (await s.read_timings()) is not None and len(s.tokens) == 1
            early = s.served
            await s.result()
            assert s.served == early
            return early

    assert asyncio.run(run()) == hypic.Served(3, 0, 0, 8, "hypic", False)


@pytest.mark.processes
def test_cli_generate_says_how_it_was_served(full_mesh, capsys) -> None:
    from hypic.cli import main

    args = ["generate", "--address", full_mesh.router_address, "--segment-ids", "50,51,52,53,54,55",
            "--query", "frank likes", "--max-tokens", "2", "--timeout", "60"]
    assert main([*args, "--mode", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["served"] == dict(reused=0, built=0, recomputed=1, seam=0, mode="full", shadowed=False)
    assert out["timings"]["served_mode"] == "full" and out["timings"]["recomputed"] == 1
    assert main(args) == 0
    assert "0 cached {}, 1 built, 0 recomputed), hypic seam 8," in capsys.readouterr().err


@pytest.mark.processes
def test_cli_info_shows_each_workers_entry_format_and_the_cache_by_format(full_mesh, capsys) -> None:
    """`hypic info`: the format each scatter builds and each combine composes, as they say it
    now, and each segcache tier's bytes and entries per format (the entries scatter stored)."""
    from common.engine.dtypes import WORKER_ENTRY_FORMAT
    from hypic.cli import main

    with hypic.Client(full_mesh.router_address, timeout=60) as c:
        c.generate(segments=[[61, 62, 63, 64, 65, 66, 67, 68, 69, 70]], query="gina likes", max_tokens=1,
                   stream=False)
    time.sleep(0.5)  # scatter's store ends after the answer
    assert main(["info", "--address", full_mesh.router_address]) == 0
    info = json.loads(capsys.readouterr().out)
    formats = info["entry_formats"]
    fmt = WORKER_ENTRY_FORMAT  # the mesh runs the workers' default format (bf16)
    assert formats == {"scatter": {full_mesh["scatter0"].address: fmt},
                       "combine": {full_mesh["combine0"].address: fmt}, "mixed": False}
    [cache] = info["cache"].values()
    disk = cache["tiers"]["disk"]
    assert disk["entries"] >= 1 and disk["formats"] == {fmt: {"bytes": disk["bytes"], "entries": disk["entries"]}}
