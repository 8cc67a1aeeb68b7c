"""deploy/k8s as the deploy tests read it, without a cluster: the kustomization, every object it
lists by (kind, name), and the lookups the tests share (workloads, hypic containers and the
config each one loads, the pods a selector picks). The fixtures are in tests/deploy/conftest.py."""

from __future__ import annotations

from pathlib import Path

import kubernetes.client as k8s
import yaml

from common.mesh.config import load_config
from tests.support.service_configs import service_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MODELS = {
    ("v1", "Namespace"): k8s.V1Namespace,
    ("v1", "Service"): k8s.V1Service,
    ("v1", "PersistentVolumeClaim"): k8s.V1PersistentVolumeClaim,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("apps/v1", "StatefulSet"): k8s.V1StatefulSet,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): k8s.V2HorizontalPodAutoscaler,
    ("policy/v1", "PodDisruptionBudget"): k8s.V1PodDisruptionBudget,
}
GRPC_SERVICES = {"segcache": "hypic.v1.Segcache", "scatter": "hypic.v1.Scatter",
                 "combine": "hypic.v1.Combine", "router": "hypic.v1.Router"}
HTTP_SERVICES = {"front"}
# Files the kustomization's secretGenerator reads besides what `hypic certs` writes (docs/deploy.md).
HAND_MADE_SECRET_FILES = {"entry.key", "api-key", "front-api-key"}
CERT_NAMES = ("segcache", "scatter", "combine", "router", "front")


def load_kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def load_objects(kustomization: dict) -> dict[tuple[str, str], dict]:
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


def workloads(objects: dict) -> dict[str, dict]:
    """Deployments and StatefulSets (segcache's members), by name."""
    return of_kind(objects, "Deployment") | of_kind(objects, "StatefulSet")


def hypic_containers(objects: dict):
    for name, dep in workloads(objects).items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            kind = service_kind(c)
            if kind:
                yield name, dep, c, kind


def loaded_config(container: dict, kind: str):
    cls, prefix = service_config(kind)
    env = {e["name"]: (e["value"] if "value" in e else "from-the-pod") for e in container["env"]}
    return load_config(cls, [], env=env, env_prefix=prefix)



def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_of(objects: dict, selector: dict) -> list[str]:
    return [n for n, d in workloads(objects).items()
            if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
