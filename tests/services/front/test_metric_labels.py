"""The front's metric label sets stay bounded whatever clients send (issue 30): requests with many
distinct paths, models, modes, methods and keys, authorised and not, add no series after the
first round. The front runs in process (a real app, no router behind it: generation answers 503)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from hypic.launcher import DEFAULT_MODEL
from services.front import metrics as m
from services.front.app import create_app
from services.front.config import FrontConfig
from services.front.segments import ChatTemplate
from tests.support.peers import closed_port

KEY = "sekret"


def front_series() -> dict[str, set[tuple]]:
    """Every hypic_ sample the process exports, by name: the set of label sets seen."""
    out: dict[str, set[tuple]] = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith("hypic_"):
                out.setdefault(s.name, set()).add(tuple(sorted(s.labels.items())))
    return out


def hostile_round(http: TestClient, tag: str, n: int) -> None:
    """n requests of each kind, every one with a path, model, mode or key not seen before."""
    good = {"Authorization": f"Bearer {KEY}"}
    for i in range(n):
        u = f"{tag}{i}"
        http.get(f"/v1/x{u}")                                                  # 401, unknown path
        http.post(f"/v1/{u}/completions", json={"model": u})                   # 401
        http.get("/v1/models", headers={"Authorization": f"Bearer {u}"})       # 401, wrong key
        http.get(f"/v1/x{u}", headers=good)                                    # 404
        http.get(f"/{u}")                                                      # 404 outside /v1
        http.request(f"X{i % 7}" if i % 2 else "DELETE", "/health")            # 405
        http.post("/v1/completions", headers=good, json={"model": u, "prompt": "a"})
        http.post("/v1/chat/completions", headers=good,
                  json={"model": DEFAULT_MODEL.name, "mode": u, "messages": [{"role": "user",
                                                                             "content": u}]})
        http.post("/v1/completions", headers=good, content=b"{" + u.encode())  # bad JSON


def test_series_count_fixed_under_distinct_paths_models_and_modes() -> None:
    cfg = FrontConfig(router_addresses=f"127.0.0.1:{closed_port()}", request_timeout_s=2,
                      api_key=KEY)
    with TestClient(create_app(cfg, ChatTemplate.load(DEFAULT_MODEL))) as http:
        hostile_round(http, "a", 3)
        before = front_series()
        hostile_round(http, "b", 40)
        after = front_series()
    assert sum(map(len, after.values())) == sum(map(len, before.values())), \
        {k: len(v - before.get(k, set())) for k, v in after.items() if v - before.get(k, set())}
    endpoints = {dict(labels)["endpoint"] for labels in after["hypic_front_http_requests_total"]}
    assert endpoints <= m.KNOWN_PATHS | {m.OTHER, m.UNAUTHENTICATED}
    assert m.UNAUTHENTICATED in endpoints and m.OTHER in endpoints
    for labels in after["hypic_front_http_requests_total"]:
        status = dict(labels)["status"]
        assert status in {str(s) for s in m.KNOWN_STATUSES} | {"1xx", "2xx", "3xx", "4xx", "5xx"}


def test_labels_of_unknown_values_map_onto_fixed_sets() -> None:
    assert m.endpoint_label("/v1/models") == "/v1/models"
    assert m.endpoint_label("/v1/models/") == m.endpoint_label("/v1/x") == m.OTHER
    assert m.status_label(404) == "404" and m.status_label(418) == "4xx"
    assert m.status_label(299) == "2xx" and m.status_label(999) == "5xx"
    assert m.status_label(0) == "1xx"
    assert m.tier_label("host") == "host" and m.tier_label("x" * 50) == "unknown"
