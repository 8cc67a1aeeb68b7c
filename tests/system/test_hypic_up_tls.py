"""`hypic up --tls --api-key KEY`, the secure mode of the command users run, on real processes.

Every service runs mutual TLS with a throwaway CA, the front included: it serves HTTPS that asks
its clients for a certificate of the mesh CA and the key, and it is an mTLS client of the router
(the "front" certificate). The same greedy question answered through the SDK (gRPC, client
certificate + key), the official `openai` client and curl (HTTPS, client certificate + key) gives
the same text; without the certificate, without the key or in plaintext the front refuses."""
from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading

import httpx
import openai
import pytest

import hypic
from hypic.launcher import DEFAULT_MODEL
from hypic.processes import REPO_ROOT

MODEL = DEFAULT_MODEL.name
DOCS = ["<doc> the red key is under the blue stone .", "<doc> the green box holds a small cat ."]
QUESTION = "where is the red key ?"
START_TIMEOUT_S = 300


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of `proc` (the --json description), or "" after timeout_s."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else ""


@pytest.fixture(scope="module")
def api_key() -> str:
    return os.urandom(12).hex()


@pytest.fixture(scope="module")
def up(api_key, tmp_path_factory):
    """`hypic up --tls --api-key` as a user starts it; its --json description."""
    data = tmp_path_factory.mktemp("up")
    cmd = [sys.executable, "-m", "hypic", "up", "--tls", "--api-key", api_key, "--json",
           "--data-dir", str(data), "--scatter", "1", "--threads", "1", "--port", "0",
           "--front-port", "0", "--no-metrics", "--no-restart",
           "--start-timeout", str(START_TIMEOUT_S)]
    with open(data / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = _read_line(proc, START_TIMEOUT_S + 30)
        if not line:
            proc.kill()
            pytest.fail("hypic up --tls did not start:\n" + (data / "up.log").read_text()[-4000:])
        yield json.loads(line)
    finally:
        proc.send_signal(signal.SIGTERM)  # hypic up stops its mesh on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tls(up) -> tuple[str, str, str]:
    t = up["tls"]
    return t["ca"], t["cert"], t["key"]


def _front_host_port(up) -> str:
    url = up["front"]
    assert url.startswith("https://"), f"the front serves HTTPS under --tls: {url}"
    return url.removeprefix("https://")


def _sdk_text(up, api_key) -> str:
    ca, cert, key = _tls(up)
    creds = hypic.Credentials(tls_ca=ca, tls_cert=cert, tls_key=key, api_key=api_key)
    with hypic.Client(up["router"], timeout=120, credentials=creds) as c:
        return c.generate(segments=DOCS, query=QUESTION, max_tokens=3, stream=False).text


def _client_context(up, with_cert: bool = True) -> ssl.SSLContext:
    ca, cert, key = _tls(up)
    ctx = ssl.create_default_context(cafile=ca)
    if with_cert:
        ctx.load_cert_chain(cert, key)
    return ctx


COMPLETION = {"model": MODEL, "prompt": " # # ".join([*DOCS, QUESTION]), "max_tokens": 3,
              "temperature": 0}


@pytest.mark.processes
@pytest.mark.slow
def test_sdk_openai_and_curl_answer_alike_over_mutual_tls(up, api_key) -> None:
    expected = _sdk_text(up, api_key)
    assert expected, "the SDK got an answer through the mTLS router with the key"
    http = httpx.Client(verify=_client_context(up), timeout=120)
    api = openai.OpenAI(base_url=up["front"] + "/v1", api_key=api_key, http_client=http, max_retries=0)
    assert [m.id for m in api.models.list().data] == [MODEL]
    r = api.completions.create(**COMPLETION)
    assert r.choices[0].text == expected, "the front (an mTLS client of the router) answers like the SDK"
    ca, cert, key = _tls(up)
    out = subprocess.run(
        ["curl", "-sS", "--fail-with-body", "--max-time", "120", "--cacert", ca, "--cert", cert, "--key", key,
         "-H", f"Authorization: Bearer {api_key}", "-H", "Content-Type: application/json",
         "-d", json.dumps(COMPLETION), up["front"] + "/v1/completions"],
        capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr + out.stdout
    assert json.loads(out.stdout)["choices"][0]["text"] == expected


@pytest.mark.processes
@pytest.mark.slow
def test_front_refuses_without_certificate_key_or_tls(up, api_key) -> None:
    host_port = _front_host_port(up)
    with httpx.Client(verify=_client_context(up), timeout=30) as http:
        assert http.get(up["front"] + "/v1/models").status_code == 401, "no key: 401"
        assert http.get(up["front"] + "/v1/models", headers={
            "Authorization": f"Bearer {api_key}"}).status_code == 200
    with httpx.Client(verify=_client_context(up, with_cert=False), timeout=30) as http:
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            http.get(up["front"] + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    with httpx.Client(timeout=30) as http:
        with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port: no answer
            http.get(f"http://{host_port}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    ca, _, _ = _tls(up)
    out = subprocess.run(["curl", "-sS", "--max-time", "30", "--cacert", ca,
                          "-H", f"Authorization: Bearer {api_key}", up["front"] + "/v1/models"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, "curl without a client certificate gets no answer"
