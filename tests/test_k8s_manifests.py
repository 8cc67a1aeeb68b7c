"""deploy/k8s, checked without a cluster: every manifest loads into the `kubernetes` client's
models (which forbid unknown fields, so a misspelt key fails), the kustomization's references
resolve, every HYPIC_* variable is a field of that service's config and the config loads,
ports, Services and probes agree, dns:/// targets name headless Services of the right pods,
HPAs, PDBs and volumes point at what exists, and the termination grace period covers the
service's own graceful shutdown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

from common.rpc.config import load_config
from common.rpc.discovery import parse_target
from service_configs import service_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
MODELS = {
    ("v1", "Namespace"): k8s.V1Namespace,
    ("v1", "Service"): k8s.V1Service,
    ("v1", "PersistentVolumeClaim"): k8s.V1PersistentVolumeClaim,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): k8s.V2HorizontalPodAutoscaler,
    ("policy/v1", "PodDisruptionBudget"): k8s.V1PodDisruptionBudget,
}
GRPC_SERVICES = {"segcache": "hypic.v1.Segcache", "scatter": "hypic.v1.Scatter",
                 "combine": "hypic.v1.Combine", "router": "hypic.v1.Router"}


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> dict[tuple[str, str], dict]:
    """(kind, name) -> manifest, from every resource the kustomization lists."""
    out = {}
    for res in kustomization["resources"]:
        path = K8S / res
        assert path.is_file(), f"kustomization names {res}, which does not exist"
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def of_kind(objects: dict, kind: str) -> dict[str, dict]:
    return {name: doc for (k, name), doc in objects.items() if k == kind}


def service_kind(container: dict) -> str | None:
    """'router' for `python -m services.router`; None for a container of something else."""
    cmd = container.get("command") or []
    if cmd[:2] == ["python", "-m"] and cmd[2].startswith("services."):
        return cmd[2].split(".")[1]
    return None


def hypic_containers(objects: dict):
    for name, dep in of_kind(objects, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            kind = service_kind(c)
            if kind:
                yield name, dep, c, kind


def loaded_config(container: dict, kind: str):
    cls, prefix = service_config(kind)
    env = {e["name"]: (e["value"] if "value" in e else "from-the-pod") for e in container["env"]}
    return load_config(cls, [], env=env, env_prefix=prefix)


def test_every_resource_file_is_listed_and_loads_strictly(objects) -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed, on_disk ^ listed
    for (kind, name), doc in objects.items():
        model = MODELS.get((doc["apiVersion"], kind))
        assert model is not None, f"{kind}/{name}: unexpected {doc['apiVersion']} {kind}"
        model.model_validate(doc)  # pydantic, extra="forbid": unknown fields raise


def test_strict_loading_catches_a_misspelt_field(objects) -> None:
    doc = yaml.safe_load(yaml.safe_dump(of_kind(objects, "Deployment")["scatter"]))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessPobe"] = {}
    with pytest.raises(Exception, match="readinessPobe"):
        k8s.V1Deployment.model_validate(doc)


def test_kustomization_images_name_the_containers_images(kustomization, objects) -> None:
    images = {c["image"] for d in of_kind(objects, "Deployment").values()
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert {i["name"] for i in kustomization["images"]} == images
    ns = of_kind(objects, "Namespace")
    assert list(ns) == [kustomization["namespace"]]


def test_hypic_env_vars_are_config_fields_and_load(objects) -> None:
    kinds = set()
    for name, _, c, kind in hypic_containers(objects):
        kinds.add(kind)
        cls, prefix = service_config(kind)
        fields = {f.name for f in dataclasses.fields(cls)}
        for e in c["env"]:
            var = e["name"]
            assert var.startswith(prefix), f"{name}: {var} lacks the {prefix} prefix"
            assert var[len(prefix):].lower() in fields, f"{name}: {var} is not a {cls.__name__} field"
        cfg = loaded_config(c, kind)
        assert cfg.host == "0.0.0.0", f"{name} must listen beyond its pod"
    assert kinds == set(GRPC_SERVICES)


def test_ports_probes_and_grace_periods_match_the_config(objects) -> None:
    for name, dep, c, kind in hypic_containers(objects):
        cfg = loaded_config(c, kind)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == cfg.port, name
        if cfg.metrics_port >= 0:
            assert ports["metrics"] == cfg.metrics_port, name
            annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
            assert annotations.get("prometheus.io/port") == str(cfg.metrics_port), name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == cfg.port, f"{name} {probe}"
        assert c["readinessProbe"]["grpc"]["service"] == GRPC_SERVICES[kind], name
        drain = cfg.grace_s + getattr(cfg, "drain_s", 0.0)
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + 5, f"{name}: {grace} s to stop, the service takes {drain} s"
        if kind in ("scatter", "combine"):
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", name


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_of(objects: dict, selector: dict) -> list[str]:
    return [n for n, d in of_kind(objects, "Deployment").items()
            if selects(selector, d["spec"]["template"]["metadata"]["labels"])]


def test_services_select_pods_and_target_their_ports(objects) -> None:
    for name, svc in of_kind(objects, "Service").items():
        deps = pods_of(objects, svc["spec"]["selector"])
        assert len(deps) == 1, f"Service {name} selects {deps}"
        dep = of_kind(objects, "Deployment")[deps[0]]
        named = {p["name"]: p["containerPort"]
                 for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named, f"Service {name}: no container port {p['targetPort']}"
            assert p["port"] == named[p["targetPort"]], f"Service {name}: {p}"
    for name, dep in of_kind(objects, "Deployment").items():
        assert selects(dep["spec"]["selector"]["matchLabels"],
                       dep["spec"]["template"]["metadata"]["labels"]), name


def resolve_target(objects: dict, address: str, want_kind: str, who: str) -> None:
    """`address` (host:port or dns:///name:port) names a Service of `want_kind` pods on its
    gRPC port; dns:/// targets must name a headless Service (every pod a member)."""
    t = parse_target(address)
    if t.is_dns:
        host, port, headless = t.name.split(".")[0], t.port, True
    else:
        assert len(t.static) == 1, f"{who}: {address}"
        host, p = t.static[0].rsplit(":", 1)
        host, port, headless = host.split(".")[0], int(p), False
    svc = of_kind(objects, "Service").get(host)
    assert svc is not None, f"{who}: {address} names no Service"
    if headless:
        assert svc["spec"].get("clusterIP") == "None", f"{who}: {host} is not headless"
    assert port in [p["port"] for p in svc["spec"]["ports"]], f"{who}: {address} port"
    kinds = {kind for n, _, _, kind in hypic_containers(objects)
             if n in pods_of(objects, svc["spec"]["selector"])}
    assert kinds == {want_kind}, f"{who}: {address} reaches {kinds}, not {want_kind}"


def test_addresses_resolve_to_the_right_services(objects) -> None:
    n = 0
    for name, _, c, kind in hypic_containers(objects):
        cfg = loaded_config(c, kind)
        if kind in ("scatter", "combine", "router") and cfg.segcache_address:
            resolve_target(objects, cfg.segcache_address, "segcache", name)
        if kind == "router":
            resolve_target(objects, cfg.scatter_addresses, "scatter", name)
            resolve_target(objects, cfg.combine_addresses, "combine", name)
            assert cfg.scatter_target.is_dns and cfg.combine_target.is_dns, "discovery, not lists"
            n += 1
    assert n == 1


def test_autoscalers_budgets_and_volumes_point_at_what_exists(objects) -> None:
    deps = of_kind(objects, "Deployment")
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {"scatter", "combine"}
    for name, h in hpas.items():
        ref = h["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deps, name
        assert h["spec"]["minReplicas"] <= deps[ref["name"]]["spec"]["replicas"] <= \
            h["spec"]["maxReplicas"], name
    pdbs = of_kind(objects, "PodDisruptionBudget")
    assert {"scatter", "combine", "router"} <= set(pdbs)
    for name, p in pdbs.items():
        assert pods_of(objects, p["spec"]["selector"]["matchLabels"]), f"PDB {name} selects nothing"
    claims = set(of_kind(objects, "PersistentVolumeClaim"))
    for name, dep in deps.items():
        spec = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{name}: mount of unknown volume {m['name']}"
        for v in vols.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
    seg = deps["segcache"]
    assert seg["spec"]["strategy"]["type"] == "Recreate"  # a ReadWriteOnce LMDB volume
    data_dir = str(loaded_config(seg["spec"]["template"]["spec"]["containers"][0], "segcache").data_dir)
    mounts = [m["mountPath"] for m in seg["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]]
    assert any(data_dir.startswith(m) for m in mounts), "segcache's LMDB is not on the volume"
    assert "mooncake-master" in deps and "mooncake-master" in of_kind(objects, "Service")
