"""The shadow recompute over a whole mesh (issue 26) on the bundled model, at --shadow-rate 1.0:
N hypic requests give N shadows, counted in Router.Info's drift, the router's and the front's
/metrics and the logs; what a client receives never carries argmax_id (nor logits it did not
ask for); a full-mode request is never shadowed."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hypic
from hypic.cli import main as cli_main
from hypic.launcher import Mesh
from hypic.messages import DriftSummary
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc

pytestmark = [pytest.mark.timeout(420), pytest.mark.processes]

N = 4
MODEL_LABEL = "hypic-tiny-qwen35"  # the bundled model's directory name


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # --no-drift-guard: this test is about the monitor; the guard would change the seams
    with Mesh(None, tmp_path_factory.mktemp("shadow"), n_scatter=0, threads=1, front=True,
              start_timeout_s=240, extra_args={
                  "router": ["--shadow-rate", "1.0", "--no-drift-guard", "--metrics-port", "0"]}) as m:
        yield m
    assert m.exit_codes and all(c == 0 for c in m.exit_codes.values()), m.exit_codes


def samples(url: str) -> list:
    body = urllib.request.urlopen(url, timeout=30).read().decode()
    return [s for fam in text_string_to_metric_families(body) for s in fam.samples]


def value(found: list, name: str, **labels) -> float:
    hits = [s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def generate(address: str, rid: str, seed: int, mode=router_pb.PREFILL_MODE_HYPIC,
             return_logits: bool = False) -> list[router_pb.TokenEvent]:
    docs = [[(seed * 31 + i * 7 + j) % 97 + 3 for j in range(40)] for i in range(3)]
    req = router_pb.GenerateRequest(
        segments=[router_pb.Segment(token_ids=d) for d in docs],
        query=router_pb.Segment(token_ids=[5, 9, 11]), max_tokens=8, mode=mode,
        return_logits=return_logits, stop_at_eos=False, request_id=rid)
    with grpc.insecure_channel(address) as ch:
        events = list(router_grpc.RouterStub(ch).Generate(req, timeout=120))
    return [e.token for e in events if e.HasField("token")]


def drift(mesh) -> DriftSummary:
    with hypic.Client(mesh.router_address, timeout=30) as c:
        return c.info().drift


def wait_shadowed(mesh, n: int, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        d = drift(mesh)
        if d.shadowed + d.dropped >= n or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_every_hypic_request_is_shadowed_and_the_client_never_sees_it(mesh, capsys):
    rids = [f"shadow-{i}" for i in range(N)]
    for i, rid in enumerate(rids):
        tokens = generate(mesh.router_address, rid, i, return_logits=(i == 1))
        assert len(tokens) == 8
        assert all(t.argmax_id == 0 for t in tokens), "argmax_id is never sent on"
        assert any(t.token_id != 0 for t in tokens)  # greedy picks that were not 0: they were stripped
        assert all(not t.logits for t in tokens[1:])
        assert bool(tokens[0].logits) == (i == 1), "logits only when the client asked for them"
        # one at a time: the next request does not find combine busy with this one's shadow
        d = wait_shadowed(mesh, i + 1)
        assert (d.shadowed, d.dropped) == (i + 1, 0), d
    generate(mesh.router_address, "full-0", 9, mode=router_pb.PREFILL_MODE_FULL)
    d = drift(mesh)
    assert (d.sample_rate, d.sampled, d.shadowed, d.dropped, d.window) == (1.0, N, N, 0, N), d
    assert d.kl_mean >= 0 and 0 <= d.top1_rate <= 1 and 0 <= d.agreement_mean <= 1

    router = samples(f"http://127.0.0.1:{mesh['router'].info['metrics_port']}/metrics")
    labels = {"model": MODEL_LABEL, "seam": "8"}
    assert value(router, "hypic_shadow_sampled_total", **labels) == N
    assert value(router, "hypic_shadow_shadowed_total", **labels) == N
    assert value(router, "hypic_shadow_kl_count", **labels) == N
    assert value(router, "hypic_shadow_agreement_count", **labels) == N
    top1 = sum(s.value for s in router if s.name == "hypic_shadow_top1_total")
    assert top1 == N
    assert not [s for s in router if s.name == "hypic_shadow_dropped_total"]

    front = samples(mesh.front_url + "/metrics")
    assert value(front, "hypic_shadow_counts", count="shadowed") == N
    assert value(front, "hypic_shadow_counts", count="sampled") == N
    assert value(front, "hypic_shadow_rolling_kl_mean") == pytest.approx(d.kl_mean)
    assert value(front, "hypic_shadow_rolling_agreement_mean") == pytest.approx(d.agreement_mean)
    assert value(front, "hypic_shadow_sample_rate") == 1.0
    front_labels = {"seam": "8"}
    for figure in ("kl", "agreement"):  # the router's histograms, re-exported by the front
        assert value(front, f"hypic_front_shadow_{figure}_count", **front_labels) == N
        router_buckets = {s.labels["le"]: s.value for s in router
                          if s.name == f"hypic_shadow_{figure}_bucket" and s.labels["seam"] == "8"}
        front_buckets = {s.labels["le"]: s.value for s in front
                         if s.name == f"hypic_front_shadow_{figure}_bucket" and s.labels["seam"] == "8"}
        assert front_buckets and {float(k): v for k, v in front_buckets.items()} == \
            {float(k): v for k, v in router_buckets.items()}

    assert cli_main(["info", "--address", mesh.router_address, "--data-dir", str(mesh.data_dir)]) == 0
    shown = json.loads(capsys.readouterr().out)["drift"]  # hypic info
    assert (shown["shadowed"], shown["window"]) == (N, N) and shown["kl_mean"] == pytest.approx(d.kl_mean)

    recorded = [json.loads(line) for line in mesh.log("router").splitlines()
                if '"event": "shadow recorded"' in line]
    assert sorted(r["request_id"] for r in recorded) == rids
    computed = [line for line in mesh.log("combine0").splitlines() if '"event": "shadow computed"' in line]
    assert len(computed) == N
