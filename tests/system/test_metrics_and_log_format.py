"""One metric namespace and one log format across the mesh.

Every Prometheus family that segcache, scatter, combine, router and the front expose starts with
`hypic_` (besides prometheus_client's own process_/python_ collectors), the front carries vLLM's
request metrics under that prefix with a `model_name` label, and every line a service writes,
its libraries' stdlib logging included (grpc, asyncio, uvicorn's access log, nixl, warnings), is
one JSON object with `event` and `level`. Real processes: one mesh with the front, and a lone
segcache at --log-level debug (where grpc's own Python logger speaks).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import grpc
import httpx
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from bench.quality.tasks import eval_prompt
from common.mesh.log import adopt_library_loggers, setup_logging
from hypic.launcher import Mesh

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]

REPO = Path(__file__).resolve().parents[2]
MODEL = "hypic-tiny-qwen35"
GRPC_KINDS = ("segcache", "scatter", "combine", "router")
# prometheus_client's default collectors (process_*, python_gc_*, python_info): not ours to name.
LIBRARY_PREFIXES = ("process_", "python_")
# A family of its own that each service must expose (so an empty scrape cannot pass).
OWN_FAMILY = {"segcache": "hypic_segcache_hits", "scatter0": "hypic_scatter_builds",
              "combine0": "hypic_combine_requests", "router": "hypic_router_requests"}
# vLLM's request metrics (vllm:<name>), here hypic_<name>; counters without their _total.
VLLM_FAMILIES = ("hypic_time_to_first_token_seconds", "hypic_e2e_request_latency_seconds",
                 "hypic_inter_token_latency_seconds", "hypic_prompt_tokens",
                 "hypic_generation_tokens", "hypic_prompt_tokens_cached",
                 "hypic_request_prompt_tokens", "hypic_request_generation_tokens",
                 "hypic_request_success", "hypic_num_requests_running")


def assert_json_lines(text: str, where: str) -> list[dict]:
    """Every non-empty line of `text` is a JSON object with `event` and `level`; returns them."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            raise AssertionError(f"{where}:{n} is not JSON: {line!r}") from None
        assert isinstance(d, dict) and "event" in d and "level" in d, f"{where}:{n}: {line!r}"
        out.append(d)
    return out


# ---- in-process: the stdlib -> structlog routing --------------------------------------------------

@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**config)


def test_stdlib_records_render_as_structlog_json(restore_logging, capsys) -> None:
    # A library that printed on its own before setup (as nixl's dictConfig does on stdout).
    own = logging.getLogger("hypic_test_lib")
    own.addHandler(logging.StreamHandler(sys.stdout))
    own.propagate = False
    out = io.StringIO()
    log = setup_logging("obs", "info", stream=out)
    structlog.contextvars.bind_contextvars(request_id="rid-7")
    try:
        log.info("ours", n=1)
        logging.getLogger("grpc._server").warning("grpc says %s", "hi")
        logging.getLogger("grpc._server").info("below the libraries' level")
        own.warning("library with its own handler")
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:9", "POST",
                                                 "/v1/completions", "1.1", 400)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("deprecated thing", DeprecationWarning)
        try:
            raise KeyError("k")
        except KeyError:
            logging.getLogger("asyncio").exception("task failed")
        late = logging.getLogger("hypic_test_late")  # installs its handler after setup
        late.addHandler(logging.StreamHandler(sys.stderr))
        late.propagate = False
        adopt_library_loggers()
        late.error("late library")
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
        logging.getLogger("uvicorn.access").setLevel(logging.NOTSET)
    printed = capsys.readouterr()  # nothing printed on its own, in its own format
    assert "library" not in printed.out + printed.err, printed
    lines = assert_json_lines(out.getvalue(), "stream")
    by_event = {d["event"]: d for d in lines}
    assert "below the libraries' level" not in by_event
    assert set(by_event) == {"ours", "grpc says hi", "library with its own handler",
                             '127.0.0.1:9 - "POST /v1/completions HTTP/1.1" 400', "task failed",
                             "late library"} | {e for e in by_event if "deprecated thing" in e}
    assert any("DeprecationWarning: deprecated thing" in e for e in by_event)
    for d in lines:  # one format: the same keys as our own lines, the stdlib logger's name added
        assert d["service"] == "obs" and d["request_id"] == "rid-7" and d["timestamp"]
        assert ("logger" in d) == (d["event"] != "ours")
    assert by_event["grpc says hi"]["level"] == "warning"
    assert by_event["grpc says hi"]["logger"] == "grpc._server"
    access = by_event['127.0.0.1:9 - "POST /v1/completions HTTP/1.1" 400']
    assert (access["method"], access["path"], access["status"]) == ("POST", "/v1/completions", 400)
    assert "KeyError: 'k'" in by_event["task failed"]["exception"]
    assert by_event["library with its own handler"]["logger"] == "hypic_test_lib"


# ---- a lone segcache at debug: grpc's Python logger speaks ------------------------------------------

def test_service_at_debug_writes_only_json_lines(tmp_path) -> None:
    port_file = tmp_path / "segcache.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPIC_", "GRPC_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.segcache", "--port", "0", "--port-file", str(port_file),
         "--data-dir", str(tmp_path / "data"), "--log-level", "debug", "--metrics-port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        info = json.loads(port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{info['port']}") as ch:
            with pytest.raises(grpc.RpcError) as e:  # a method nobody serves
                ch.unary_unary("/hypic.v1.Segcache/NoSuchMethod")(b"", timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    lines = assert_json_lines(stdout, "stdout") + assert_json_lines(stderr, "stderr")
    assert [d["event"] for d in lines if "logger" not in d][-1] == "stopped"
    assert any(d.get("logger", "").startswith("grpc") for d in lines), \
        sorted({d.get("logger") for d in lines}, key=str)


# ---- the whole mesh ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Mesh(None, tmp_path_factory.mktemp("obs"), n_scatter=1, threads=1, front=True,
              start_timeout_s=240,
              extra_args={k: ["--metrics-port", "0"] for k in GRPC_KINDS}) as m:
        docs = [" ".join(d) for d in eval_prompt("retrieval", 5)[0].docs]
        prompt = " # # ".join(docs + ["<q> where <a>"])
        for _ in range(2):  # the second over the same documents: cache hits
            r = httpx.post(m.front_url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
        assert httpx.post(m.front_url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"}).status_code == 400
        yield m


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}


def test_every_metric_family_has_the_hypic_prefix(mesh) -> None:
    scraped = {name: f"http://127.0.0.1:{mesh[name].info['metrics_port']}/metrics"
               for name in mesh.names if name != "front"}
    scraped["front"] = mesh.front_url + "/metrics"
    for name, url in scraped.items():
        fams = families(url)
        ours = {n for n in fams if not n.startswith(LIBRARY_PREFIXES)}
        assert ours and all(n.startswith("hypic_") for n in ours), (name, sorted(ours))
        if name in OWN_FAMILY:
            assert {OWN_FAMILY[name], "hypic_rpc_latency_seconds", "hypic_rpc"} <= ours, name
    front = families(scraped["front"])
    assert set(VLLM_FAMILIES) <= set(front), sorted(set(VLLM_FAMILIES) - set(front))
    for name in ("hypic_time_to_first_token_seconds", "hypic_e2e_request_latency_seconds",
                 "hypic_prompt_tokens", "hypic_generation_tokens", "hypic_request_success"):
        samples = front[name].samples
        assert samples and all(s.labels.get("model_name") == MODEL for s in samples), name
    cached = front["hypic_prompt_tokens_cached"].samples
    assert cached and all(s.labels["model_name"] == MODEL and s.labels["tier"] for s in cached)


def test_every_metric_the_grafana_dashboard_queries_is_scraped(mesh) -> None:
    """deploy/grafana/hypic.json queries only families that a running mesh exports (a renamed
    metric would leave an empty panel nobody notices)."""
    dashboard = json.loads((REPO / "deploy" / "grafana" / "hypic.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    queried = {re.sub(r"_(bucket|total|sum|count)$", "", name)
               for e in exprs for name in re.findall(r"\bhypic_[a-z0-9_]+", e)}
    urls = [f"http://127.0.0.1:{mesh[name].info['metrics_port']}/metrics"
            for name in mesh.names if name != "front"] + [mesh.front_url + "/metrics"]
    exported = set().union(*(families(u) for u in urls))
    assert queried - exported == set(), sorted(queried - exported)


def test_every_log_line_of_every_service_is_json(mesh) -> None:
    for name in mesh.names:
        # The launcher's own "=== <time> start: <command>" marker opens each run of a service.
        text = "\n".join(ln for ln in mesh.log(name).splitlines() if not ln.startswith("=== "))
        lines = assert_json_lines(text, f"{name}.log")
        assert any(d["event"] == "serving" for d in lines), name
    access = [d for d in assert_json_lines(
        "\n".join(ln for ln in mesh.log("front").splitlines() if not ln.startswith("=== ")),
        "front.log") if d.get("logger") == "uvicorn.access"]
    assert {(d["method"], d["path"], d["status"]) for d in access} >= {
        ("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400)}
