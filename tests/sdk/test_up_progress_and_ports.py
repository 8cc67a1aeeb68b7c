"""`hypic up` / hypic.launcher.Mesh as an operator meets them: a taken port fails at once before
anything starts, each service is reported as it becomes ready, a service that cannot start is
reported with a one-line reason and its log's last lines, a clean stop leaves no port files,
and `hypic health --http` probes the front as `python -m hypic.healthcheck --http` does."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from hypic.launcher import Mesh, MeshError
from tests.support.peers import BlackHole, HungHttp2, closed_port
from tests.support.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(180)


def test_taken_port_fails_fast_before_anything_starts(tmp_path) -> None:
    make_tiny_model(tmp_path / "model")
    holder = BlackHole()  # something listening on the router's port
    port = int(holder.address.rsplit(":", 1)[1])
    try:
        m = Mesh(tmp_path / "model", tmp_path / "data", n_scatter=1, router_port=port)
        t0 = time.monotonic()
        with pytest.raises(MeshError, match=rf"router port {port}"):
            m.start()
        assert time.monotonic() - t0 < 2.0
        assert m.services == {}  # nothing was started
    finally:
        holder.close()


def test_free_fixed_port_is_not_reported_taken(tmp_path) -> None:
    from hypic.processes import port_taken

    holder = BlackHole()
    try:
        assert port_taken("127.0.0.1", int(holder.address.rsplit(":", 1)[1]))
    finally:
        holder.close()
    assert not port_taken("127.0.0.1", closed_port())


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_cli_health_http_like_the_healthcheck_module(capsys) -> None:
    from hypic.cli import main
    from hypic.healthcheck import main as health_main

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["health", address, "--http"]) == 0
        assert health_main([address, "--http"]) == 0
        assert "SERVING" in capsys.readouterr().out
        assert main(["health", f"127.0.0.1:{closed_port()}", "--http", "--timeout", "0.5"]) == 1
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.processes
def test_progress_per_service_and_no_port_files_after_a_clean_stop(tmp_path, capsys) -> None:
    model = make_tiny_model(tmp_path / "model")
    hung = HungHttp2()
    ready: list[tuple[str, float]] = []
    m = Mesh(model, tmp_path / "data", n_scatter=0, n_combine=0, external_combine=[hung.address],
             extra_args={"segcache": ["--no-nixl"]}, start_timeout_s=120,
             on_ready=lambda name, svc, s: ready.append((name, s)))
    try:
        with m:
            assert [n for n, _ in ready] == ["segcache", "router"]
            assert ready[0][1] <= ready[1][1]
            assert sorted(p.name for p in m.run_dir.glob("*.port.json")) == \
                ["router.port.json", "segcache.port.json"]
            _check_info(m, capsys)
    finally:
        hung.close()
    assert m.exit_codes == {"router": 0, "segcache": 0}
    assert list(m.run_dir.glob("*.port.json")) == []


@pytest.mark.processes
def test_failure_says_why_in_one_line_then_the_log_tail(tmp_path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")  # no vocab_size: the router exits
    m = Mesh(tmp_path / "bad", tmp_path / "data", n_scatter=0, n_combine=0,
             external_combine=["127.0.0.1:1"], segcache=False, start_timeout_s=60)
    with pytest.raises(MeshError) as exc:
        m.start()
    first, *rest = str(exc.value).splitlines()
    assert first.startswith("router exited with status 1 while starting: ")
    assert len(first) > len("router exited with status 1 while starting: ")
    assert "last lines of" in rest[0] and 1 < len(rest) <= 16


def _check_info(m: Mesh, capsys) -> None:
    """`hypic info`: the router's model path, the front from hypic up's mesh.json (none in this
    mesh), each segcache's bytes and budget per tier."""
    from hypic.cli import _write_mesh_file, main

    _write_mesh_file(m)  # what hypic up writes once the mesh is ready
    capsys.readouterr()
    assert main(["info", "--address", m.router_address, "--data-dir", str(m.data_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_path"] == str(m.model) and info["front"] is None
    [cache] = info["cache"].values()
    assert cache["entries"] == 0 and cache["tiers"]["host"]["budget_bytes"] > 0
    assert cache["tiers"]["host"]["bytes"] == 0
    assert main(["info", "--address", m.router_address, "--data-dir", str(m.data_dir / "x")]) == 0
    assert json.loads(capsys.readouterr().out)["front"] is None


def test_threads_default_shares_the_cores_among_model_processes(tmp_path) -> None:
    from hypic.processes import default_threads

    assert default_threads(3, cores=2) == 1   # hypic up on 2 cores: 2 scatters + a combine
    assert default_threads(3, cores=16) == 5
    assert default_threads(1, cores=8) == 8
    assert default_threads(0, cores=4) == 4   # no model process here: nothing to share
    assert default_threads(8, cores=2) == 1   # never 0 (0 would mean torch's default)

    def threads_flag(**kw) -> str | None:
        args = Mesh(tmp_path / "model", tmp_path / "data", **kw).service_args("combine")
        return args[args.index("--threads") + 1] if "--threads" in args else None

    assert threads_flag(n_scatter=2) == str(default_threads(3))
    assert threads_flag(n_scatter=2, threads=4) == "4"
    assert threads_flag(n_scatter=2, threads=0) is None  # torch's own default, as asked


def test_a_reserved_port_is_nobody_elses_yet_a_server_listens_on_it() -> None:
    import socket

    from hypic.processes import reserve_port

    held = reserve_port("127.0.0.1")
    port = held.getsockname()[1]
    try:
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))  # a bind without SO_REUSEADDR is refused
        plain.close()
        server = socket.socket()  # a server as ours bind: SO_REUSEADDR, then listen
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        server.close()
    finally:
        held.close()
