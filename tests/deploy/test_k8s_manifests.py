"""deploy/k8s, checked without a cluster: every manifest loads into the `kubernetes` client's
models (which forbid unknown fields, so a misspelt key fails), the kustomization's references
resolve, every HYPIC_* variable is a field of that service's config and the config loads,
ports, Services and probes agree, dns:/// targets name headless Services of the right pods,
HPAs, PDBs and volumes point at what exists, and the termination grace period covers the
service's own graceful shutdown. Secrets: every Secret a pod mounts or reads is one the
kustomization generates, from files `hypic certs` (or the documented commands) make; every file a
config names (certificates, keys, the entry seal key, API keys) lies in a mounted secret that
holds it; services talk mutual TLS (the router: TLS + API key, for the front and SDK clients), and
segcache's writer role goes to exactly the scatter and combine certificates. The front (HTTP)
is there with its probes on /health and its routers reached like any SDK client."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

from common.mesh.discovery import parse_target
from tests.support.k8s_manifests import (CERT_NAMES, GRPC_SERVICES, HAND_MADE_SECRET_FILES, HTTP_SERVICES, K8S, MODELS,
                                        hypic_containers, loaded_config, of_kind, pods_of, selects, workloads)
from tests.support.service_configs import service_config


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
    images = {c["image"] for d in workloads(objects).values()
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
    assert kinds == set(GRPC_SERVICES) | HTTP_SERVICES


def probe_port(container: dict, probe: str, cfg) -> int:
    """The port a probe of a gRPC service checks: kubelet's own gRPC probe (plaintext only, so
    only without TLS) or `python -m hypic.healthcheck 127.0.0.1:PORT` with this service's own
    TLS files (what a TLS server needs)."""
    p = container[probe]
    if "grpc" in p:
        assert not cfg.tls_on, f"{probe}: kubelet's gRPC probe cannot speak TLS"
        return p["grpc"]["port"]
    cmd = p["exec"]["command"]
    assert cmd[:3] == ["python", "-m", "hypic.healthcheck"], cmd
    host, port = cmd[3].rsplit(":", 1)
    assert host == "127.0.0.1", cmd
    flags = dict(zip(cmd[4::1], cmd[5::1]))
    assert flags.get("--tls-ca") == str(cfg.tls_ca), f"{probe}: {cmd}"
    if cfg.mutual_tls:
        assert (flags.get("--tls-cert"), flags.get("--tls-key")) == (str(cfg.tls_cert), str(cfg.tls_key)), cmd
    return int(port)


def probe_service(container: dict) -> str:
    p = container["readinessProbe"]
    if "grpc" in p:
        return p["grpc"].get("service", "")
    cmd = p["exec"]["command"]
    return cmd[cmd.index("--service") + 1] if "--service" in cmd else ""


def test_ports_probes_and_grace_periods_match_the_config(objects) -> None:
    for name, dep, c, kind in hypic_containers(objects):
        if kind in HTTP_SERVICES:
            continue  # test_the_front_is_there
        cfg = loaded_config(c, kind)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == cfg.port, name
        if cfg.metrics_port >= 0:
            assert ports["metrics"] == cfg.metrics_port, name
            annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
            assert annotations.get("prometheus.io/port") == str(cfg.metrics_port), name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert probe_port(c, probe, cfg) == cfg.port, f"{name} {probe}"
        assert probe_service(c) == GRPC_SERVICES[kind], name
        drain = cfg.grace_s + getattr(cfg, "drain_s", 0.0)
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + 5, f"{name}: {grace} s to stop, the service takes {drain} s"
        if kind in ("scatter", "combine"):
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", name


def test_services_select_pods_and_target_their_ports(objects) -> None:
    for name, svc in of_kind(objects, "Service").items():
        deps = pods_of(objects, svc["spec"]["selector"])
        assert len(deps) == 1, f"Service {name} selects {deps}"
        dep = workloads(objects)[deps[0]]
        named = {p["name"]: p["containerPort"]
                 for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named, f"Service {name}: no container port {p['targetPort']}"
            assert p["port"] == named[p["targetPort"]], f"Service {name}: {p}"
    for name, dep in workloads(objects).items():
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
        if kind == "front":
            for address in cfg.routers:
                resolve_target(objects, address, "router", name)
    assert n == 1


def test_autoscalers_budgets_and_volumes_point_at_what_exists(objects) -> None:
    deps = workloads(objects)
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {
        "scatter", "combine", "front", "router", "segcache"}
    for name, h in hpas.items():
        ref = h["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in objects and ref["name"] in deps, name
        assert h["spec"]["minReplicas"] <= deps[ref["name"]]["spec"]["replicas"] <= \
            h["spec"]["maxReplicas"], name
    pdbs = of_kind(objects, "PodDisruptionBudget")
    assert {"scatter", "combine", "router", "front"} <= set(pdbs)
    for name, p in pdbs.items():
        assert pods_of(objects, p["spec"]["selector"]["matchLabels"]), f"PDB {name} selects nothing"
    claims = set(of_kind(objects, "PersistentVolumeClaim"))
    for name, dep in deps.items():
        spec = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        vols |= {t["metadata"]["name"]: t for t in dep["spec"].get("volumeClaimTemplates", [])}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{name}: mount of unknown volume {m['name']}"
        for v in vols.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
    seg = of_kind(objects, "StatefulSet")["segcache"]  # each member its own LMDB volume
    assert [t["metadata"]["name"] for t in seg["spec"]["volumeClaimTemplates"]] == ["data"]
    data_dir = str(loaded_config(seg["spec"]["template"]["spec"]["containers"][0], "segcache").data_dir)
    mounts = {m["mountPath"]: m["name"]
              for m in seg["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert any(data_dir.startswith(m) and v == "data" for m, v in mounts.items()), \
        "segcache's LMDB is not on the member's own volume"
    assert "mooncake-master" in deps and "mooncake-master" in of_kind(objects, "Service")


# ---- the front ------------------------------------------------------------------------------------
def test_the_front_is_there(objects) -> None:
    fronts = [(n, d, c) for n, d, c, kind in hypic_containers(objects) if kind == "front"]
    assert len(fronts) == 1
    name, dep, c = fronts[0]
    cfg = loaded_config(c, "front")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == cfg.port and cfg.host == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == "http" and c[probe]["httpGet"]["scheme"] == "HTTPS"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(cfg.port) and annotations["prometheus.io/path"] == "/metrics"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= cfg.grace_s + 5
    assert cfg.routers_ca is not None and cfg.router_api_key.startswith("@"), "TLS and the key to the routers"
    # HTTPS with its own certificate, which it also shows to the routers (mutual TLS)
    assert cfg.https and cfg.tls_on and annotations.get("prometheus.io/scheme") == "https"
    svc = of_kind(objects, "Service")["front"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [cfg.port]


# ---- secrets ----------------------------------------------------------------------------------------
def generated_secrets(kustomization) -> dict[str, dict[str, str]]:
    """secretGenerator: Secret name -> {key in the Secret: source file (relative to deploy/k8s)}."""
    out = {}
    for g in kustomization.get("secretGenerator", []):
        keys = {}
        for spec in g.get("files", []):
            key, _, path = spec.partition("=")
            keys[key] = path or key
        if g.get("type") == "kubernetes.io/tls":
            assert set(keys) == {"tls.crt", "tls.key"}, g["name"]
        out[g["name"]] = keys
    return out


def mounted_files(spec: dict, container: dict, secrets: dict) -> dict[str, tuple[str, str]]:
    """Absolute path in the container -> (Secret, key), for every secret file it mounts; each
    referenced Secret and key must be one the kustomization generates."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        v = vols.get(m["name"], {})  # absent: a volumeClaimTemplate (segcache's LMDB), no secret
        sources = [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
        if "secret" in v:
            sources.append({"name": v["secret"]["secretName"], **({"items": v["secret"]["items"]}
                                                                  if "items" in v["secret"] else {})})
        for src in sources:
            assert src["name"] in secrets, f"{container['name']}: Secret {src['name']} is not generated"
            keys = secrets[src["name"]]
            items = src.get("items") or [{"key": k, "path": k} for k in keys]
            for it in items:
                assert it["key"] in keys, f"{container['name']}: {src['name']} has no key {it['key']}"
                path = f"{m['mountPath'].rstrip('/')}/{it['path']}"
                assert path not in out, f"{container['name']}: two secrets at {path}"
                out[path] = (src["name"], it["key"])
    return out


def file_fields(cfg) -> dict[str, str]:
    """Config fields that name a secret file: paths, and "@FILE" secret values."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, Path) and (f.name.startswith("tls_") or f.name.endswith(("_ca", "key_file"))):
            out[f.name] = str(v)
        elif isinstance(v, str) and v.startswith("@"):
            out[f.name] = v[1:]
    return out


def test_every_secret_and_secret_file_resolves(kustomization, objects, tmp_path) -> None:
    from hypic.certs import generate_mesh_certs

    secrets = generated_secrets(kustomization)
    made = {p.name for p in generate_mesh_certs(tmp_path, CERT_NAMES).dir.iterdir()} | HAND_MADE_SECRET_FILES
    for name, keys in secrets.items():
        for path in keys.values():
            assert path.startswith("secrets/") and Path(path).name in made, f"{name}: {path} is made by nobody"
    used = set()
    for name, dep, c, kind in hypic_containers(objects):
        spec = dep["spec"]["template"]["spec"]
        files = mounted_files(spec, c, secrets)
        used |= {s for s, _ in files.values()}
        for e in c["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets.get(ref["name"], {}), f"{name}: {e['name']} -> {ref}"
                used.add(ref["name"])
        cfg = loaded_config(c, kind)
        for field_name, path in file_fields(cfg).items():
            assert path in files, f"{name}: {field_name} = {path} is in no mounted secret"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            cmd = c[probe].get("exec", {}).get("command", [])
            for flag, value in zip(cmd, cmd[1:]):
                if flag.startswith("--tls-"):
                    assert value in files, f"{name} {probe}: {value} is in no mounted secret"
        if spec.get("volumes") and files:
            ctx = spec["securityContext"]  # mode 0440 files: readable through the pod's group
            assert ctx.get("fsGroup") == ctx.get("runAsUser"), name
    assert used == set(secrets), f"generated but never used: {set(secrets) - used}"


def test_services_talk_mutual_tls_and_only_workers_write(kustomization, objects) -> None:
    secrets = generated_secrets(kustomization)
    cfgs, files = {}, {}
    for name, dep, c, kind in hypic_containers(objects):
        if kind in HTTP_SERVICES:  # the front: HTTPS, and a client of the routers as CN=front
            cfg = loaded_config(c, kind)
            secret, _ = mounted_files(dep["spec"]["template"]["spec"], c, secrets)[str(cfg.tls_cert)]
            assert secrets[secret]["tls.crt"] == "secrets/front.pem", f"{name} presents {secret}"
            continue
        cfg = cfgs[kind] = loaded_config(c, kind)
        files[kind] = mounted_files(dep["spec"]["template"]["spec"], c, secrets)
        assert cfg.tls_on and cfg.tls_ca is not None, f"{name}: TLS off"
        secret, _ = files[kind][str(cfg.tls_cert)]
        assert secrets[secret]["tls.crt"] == f"secrets/{kind}.pem", f"{name} presents {secret}"
        if kind == "router":
            assert not cfg.mutual_tls and cfg.api_key, "router: TLS for any client, with the API key"
        else:
            assert cfg.mutual_tls, f"{name}: clients must show a mesh certificate"
    # hypic certs names each certificate's CN after its file: the writers are scatter and combine
    assert set(cfgs["segcache"].writer_names.split(",")) == {"scatter", "combine"}
    keys = {files[k][str(cfgs[k].entry_key_file)] for k in ("segcache", "scatter", "combine")}
    assert len(keys) == 1, f"one entry seal key for the mesh, not {keys}"


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the kustomization")
def test_kubectl_kustomize_renders_with_the_secrets_it_names(tmp_path) -> None:
    """The real renderer, on a copy with the secret files made as docs/deploy.md says: every
    Secret a Deployment references is a generated one (names with their content hash)."""
    from hypic.certs import generate_mesh_certs

    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets"))
    generate_mesh_certs(tree / "secrets", CERT_NAMES, extra_hosts=["router-pods"])
    for name in HAND_MADE_SECRET_FILES:
        (tree / "secrets" / name).write_text(os.urandom(16).hex())
    out = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert len(secrets) == len(yaml.safe_load((K8S / "kustomization.yaml").read_text())["secretGenerator"])
    refs = set()
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = d["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            refs |= {s["secret"]["name"] for s in v.get("projected", {}).get("sources", []) if "secret" in s}
        for c in spec["containers"]:
            refs |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                     if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == secrets, refs ^ secrets
