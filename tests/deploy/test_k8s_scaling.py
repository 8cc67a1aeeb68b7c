"""deploy/k8s scales on its own, checked without a cluster: segcache members are found by name
and grow on memory, the routers on their request rate and CPU, every Pods metric an HPA names has
a prometheus-adapter rule over a series the service exports; and the device-tier overlay
(deploy/k8s-device-tier) turns segcache's tier 0 on with real settings, as kubectl renders it."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

import kubernetes.client as k8s
import pytest
import yaml

from common.mesh.discovery import parse_target
from tests.support.k8s_manifests import (CERT_NAMES, HAND_MADE_SECRET_FILES, K8S, ROOT, hypic_containers, loaded_config,
                                        of_kind, pods_of, workloads)
from tests.support.service_configs import service_config


# ---- the cache tier and the routers scale on their own ----------------------------------------------
def test_segcache_members_are_found_by_name_and_autoscaled(objects) -> None:
    """Every client reaches segcache by its headless Service (dns:///: every member pod), the
    members are a StatefulSet governed by that Service, and HPAs grow segcache on memory and the
    routers on their request rate per pod (an adapter's Pods metric) and on CPU (what a plain
    cluster's metrics-server gives, so a cluster without an adapter still scales them up)."""
    seg = of_kind(objects, "StatefulSet")["segcache"]
    svc = of_kind(objects, "Service")[seg["spec"]["serviceName"]]
    assert svc["spec"].get("clusterIP") == "None"
    assert pods_of(objects, svc["spec"]["selector"]) == ["segcache"]
    clients = 0
    for name, _, c, kind in hypic_containers(objects):
        cfg = loaded_config(c, kind)
        if kind in ("scatter", "combine", "router"):
            assert parse_target(cfg.segcache_address).is_dns, f"{name}: segcache by a list, not by name"
            clients += 1
    assert clients >= 3
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(objects, "HorizontalPodAutoscaler").values()}
    want = {"segcache": [("Resource", "memory")],
            "router": [("Pods", "hypic_router_requests_per_second"), ("Resource", "cpu")]}
    for target, resource in (("segcache", "memory"), ("router", "cpu")):
        metrics = hpas[target]["spec"]["metrics"]
        assert [(m["type"], (m.get("resource") or m["pods"]["metric"])["name"]) for m in metrics] == want[target]
        container = workloads(objects)[target]["spec"]["template"]["spec"]["containers"][0]
        assert resource in container["resources"]["requests"], f"{target}: utilization needs a request"
        assert 2 <= hpas[target]["spec"]["minReplicas"] < hpas[target]["spec"]["maxReplicas"]


ADAPTER_VALUES = ROOT / "deploy" / "prometheus-adapter" / "values.yaml"


def test_every_pods_metric_an_hpa_names_is_served_by_the_adapter_rules(objects) -> None:
    """deploy/prometheus-adapter/values.yaml has a rule for each Pods metric an HPA scales on, and
    each rule reads a series the service exports (its metrics module, as Prometheus names it)."""
    from prometheus_client import REGISTRY

    import services.combine.metrics  # noqa: F401  (register the families)
    import services.router.metrics  # noqa: F401
    import services.scatter.metrics  # noqa: F401

    exported = {s.name for fam in REGISTRY.collect() for s in fam.samples} | \
        {fam.name for fam in REGISTRY.collect()}
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    served = {}
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert series in exported or series.removesuffix("_total") in exported, f"{series}: no service exports it"
        assert re.fullmatch(rule["name"]["matches"], series), rule
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        served[rule["name"]["as"]] = rule
    named = {m["pods"]["metric"]["name"]: h["spec"]["scaleTargetRef"]["name"]
             for h in of_kind(objects, "HorizontalPodAutoscaler").values()
             for m in h["spec"]["metrics"] if m["type"] == "Pods"}
    assert set(named) == {"hypic_scatter_queued_tokens", "hypic_combine_in_flight",
                          "hypic_router_requests_per_second"}
    assert set(named) <= set(served), set(named) - set(served)
    # a counter's HPA metric is a rate, never the ever-growing total
    assert "rate(" in served["hypic_router_requests_per_second"]["metricsQuery"]


# ---- the device-tier overlay (deploy/k8s-device-tier) ---------------------------------------------
OVERLAY = ROOT / "deploy" / "k8s-device-tier"


def _strategic_merge_container(base: dict, patch: dict) -> dict:
    """What kustomize's strategic merge does to one container for the keys the patch uses: env
    entries merged by name (a patched name replaces its value), resources.limits/requests by key."""
    out = yaml.safe_load(yaml.safe_dump(base))
    env = {e["name"]: e for e in out.get("env", [])}
    for e in patch.get("env", []):
        env[e["name"]] = e
    out["env"] = list(env.values())
    for part, values in (patch.get("resources") or {}).items():
        out.setdefault("resources", {}).setdefault(part, {}).update(values)
    return out


@pytest.fixture(scope="module")
def device_tier_segcache(objects) -> tuple[dict, dict]:
    """(the patched segcache container, the patched StatefulSet) as the overlay makes them."""
    kust = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../k8s"], "the overlay builds on the base, changing only what it patches"
    (patch_ref,) = kust["patches"]
    patch = yaml.safe_load((OVERLAY / patch_ref["path"]).read_text())
    base = objects[(patch["kind"], patch["metadata"]["name"])]
    assert (patch["kind"], patch["metadata"]["name"]) == ("StatefulSet", "segcache")
    (pc,) = patch["spec"]["template"]["spec"]["containers"]
    containers = base["spec"]["template"]["spec"]["containers"]
    (bc,) = [c for c in containers if c["name"] == pc["name"]]
    merged_c = _strategic_merge_container(bc, pc)
    sts = yaml.safe_load(yaml.safe_dump(base))
    sts["spec"]["template"]["spec"]["containers"] = [merged_c if c["name"] == pc["name"] else c for c in containers]
    return merged_c, sts


def test_device_tier_overlay_turns_tier_0_on_with_real_settings(device_tier_segcache) -> None:
    c, sts = device_tier_segcache
    k8s.V1StatefulSet.model_validate(sts)  # strict: a misspelt key in the patch fails here
    cls, prefix = service_config("segcache")
    fields = {f.name for f in dataclasses.fields(cls)}
    for e in c["env"]:
        assert e["name"].startswith(prefix) and e["name"][len(prefix):].lower() in fields, e["name"]
    cfg = loaded_config(c, "segcache")
    assert 1 << 30 <= cfg.device_bytes <= 32 << 30, "tier 0 must leave a shared GPU room for a model"
    assert cfg.device_index == 0 and cfg.host_bytes > 0  # the base's settings stay
    limits = c["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and limits["memory"] == "48Gi"


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the kustomization")
def test_kubectl_renders_the_device_tier_overlay_as_the_test_merges_it(tmp_path, device_tier_segcache) -> None:
    from hypic.certs import generate_mesh_certs

    shutil.copytree(K8S, tmp_path / "k8s", ignore=shutil.ignore_patterns("secrets"))
    shutil.copytree(OVERLAY, tmp_path / OVERLAY.name)
    generate_mesh_certs(tmp_path / "k8s" / "secrets", CERT_NAMES, extra_hosts=["router-pods"])
    for name in HAND_MADE_SECRET_FILES:
        (tmp_path / "k8s" / "secrets" / name).write_text(os.urandom(16).hex())
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path / OVERLAY.name)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    (sts,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "StatefulSet"
              and d["metadata"]["name"] == "segcache"]
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "segcache"]
    want, _ = device_tier_segcache
    env = lambda cont: {e["name"]: e.get("value", e.get("valueFrom")) for e in cont["env"]}  # noqa: E731
    assert env(c) == env(want) and c["resources"] == want["resources"]
