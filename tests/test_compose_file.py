"""docker-compose.yml and docker/Dockerfile, checked without a Docker engine: every command runs
a real module, every flag and HYPIC_* variable is a field of that service's config dataclass
(and the whole config actually loads), addresses and ports agree between services, volumes are
declared, GPUs are not shared, healthchecks call hypic.healthcheck on the service's own port."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import yaml

from common.rpc.config import load_config
from common.rpc.discovery import parse_target
from service_configs import config_flags, service_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def kind_of(svc: dict) -> str:
    cmd = svc["command"]
    assert isinstance(cmd, list) and cmd[:2] == ["python", "-m"], cmd
    module = cmd[2]
    assert module.startswith("services."), module
    return module.split(".")[1]


@pytest.fixture(scope="module")
def configs(compose) -> dict:
    """service name -> (kind, loaded config dataclass instance)."""
    out = {}
    for name, svc in compose["services"].items():
        kind = kind_of(svc)
        cls, prefix = service_config(kind)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        try:
            cfg = load_config(cls, svc["command"][3:], env=env, env_prefix=prefix)
        except SystemExit:  # argparse: unknown flag or bad value
            pytest.fail(f"{name}: {svc['command'][3:]} is not accepted by {cls.__name__}")
        out[name] = (kind, cfg)
    return out


def split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_every_command_is_a_real_module(compose) -> None:
    kinds = set()
    for name, svc in compose["services"].items():
        module = svc["command"][2]
        assert importlib.util.find_spec(module + ".__main__") is not None, f"{name}: {module}"
        kinds.add(kind_of(svc))
    assert kinds == {"segcache", "scatter", "combine", "router", "front"}


def test_flags_and_env_vars_are_config_fields(compose, configs) -> None:
    for name, svc in compose["services"].items():
        kind = kind_of(svc)
        cls, prefix = service_config(kind)
        fields = set(cls.__dataclass_fields__)
        flags = config_flags(kind)
        for arg in svc["command"][3:]:
            if arg.startswith("--"):
                assert arg in flags, f"{name}: {arg} is not a {cls.__name__} flag"
        shared = {f"HYPIC_{f.name.upper()}" for f in dataclasses.fields(cls) if f.metadata.get("shared_env")}
        for var in svc.get("environment") or {}:
            if var in shared:  # HYPIC_TLS_*: one name for the service and its healthcheck probe
                continue
            assert var.startswith(prefix), f"{name}: {var} lacks the {prefix} prefix"
            assert var[len(prefix):].lower() in fields, f"{name}: {var} is not a {cls.__name__} field"
        assert configs[name][1].host == "0.0.0.0", f"{name} must listen beyond its container"


def test_addresses_and_ports_agree(compose, configs) -> None:
    services = compose["services"]
    port = {n: cfg.port for n, (_, cfg) in configs.items()}

    def points_to(address: str, kind: str, who: str) -> str:
        t = parse_target(address)  # dns:///name:port: compose's DNS answers every replica
        assert t.is_dns or len(t.static) == 1, f"{who}: {address}"
        host, p = (t.name, t.port) if t.is_dns else split(address)
        assert host in configs, f"{who}: {address} names no service"
        assert configs[host][0] == kind, f"{who}: {address} is not a {kind}"
        assert p == port[host], f"{who}: {address} but {host} listens on {port[host]}"
        return host

    routers = [n for n, (k, _) in configs.items() if k == "router"]
    assert len(routers) == 1
    rcfg = configs[routers[0]][1]
    points_to(rcfg.segcache_address, "segcache", "router")
    # --scale scatter=N / combine=M: the router finds the replicas by name
    assert rcfg.scatter_target.is_dns and rcfg.combine_target.is_dns
    assert points_to(rcfg.scatter_addresses, "scatter", "router") == "scatter"
    assert points_to(rcfg.combine_addresses, "combine", "router") == "combine"
    fronts = [n for n, (k, _) in configs.items() if k == "front"]
    for n in fronts:
        for a in configs[n][1].routers:
            points_to(a, "router", n)
        assert str(configs[n][1].model) == str(rcfg.model), f"{n}: another model than the router's"
    for n, (k, cfg) in configs.items():
        if k in ("scatter", "combine"):
            points_to(cfg.segcache_address, "segcache", n)
            assert cfg.dtype == rcfg.dtype, f"{n}: dtype {cfg.dtype} != router's {rcfg.dtype}"
            assert str(cfg.model) == str(rcfg.model), f"{n}: another model than the router's"
            assert cfg.device.startswith("cuda")
        if getattr(cfg, "metrics_port", -1) >= 0:
            assert cfg.metrics_port != cfg.port
        # healthcheck: the real module, on the service's own port
        test = services[n]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "hypic.healthcheck"], test
        assert importlib.util.find_spec("hypic.healthcheck") is not None
        assert split(test[4]) == ("127.0.0.1", cfg.port), (n, test)
        assert all(a in ("--quiet", "-q", "--service", "--timeout") or not a.startswith("-")
                   for a in test[5:] if a != "--http")
        assert ("--http" in test) == (k == "front"), f"{n}: HTTP probe only for the front"
        for dep in services[n].get("depends_on") or {}:
            assert dep in services, f"{n} depends on unknown {dep}"
        for mapping in services[n].get("ports") or []:
            assert int(str(mapping).split(":")[-1]) == cfg.port, (n, mapping)
    published = [n for n, s in services.items() if s.get("ports")]
    assert published == routers + fronts, "only the router and the front are published"


def test_volumes_gpus_and_image(compose, configs) -> None:
    declared = set(compose.get("volumes") or {})
    for n, svc in compose["services"].items():
        targets = []
        for v in svc.get("volumes") or []:
            if isinstance(v, str):
                src, tgt = v.split(":")[:2]
                typ = "bind" if src.startswith((".", "/")) else "volume"
            else:
                src, tgt, typ = v["source"], v["target"], v["type"]
            if typ == "volume":
                assert src in declared, f"{n}: volume {src} is not declared"
            else:
                assert src.startswith("./") and ".." not in src, f"{n}: bind {src} leaves the repo"
            targets.append(tgt)
        kind, cfg = configs[n]
        if kind == "segcache":
            assert any(str(cfg.data_dir).startswith(t.rstrip("/") + "/") for t in targets), \
                "segcache's LMDB must live on a volume"
        if kind in ("scatter", "combine", "router", "front"):
            assert any(str(cfg.model).startswith(t.rstrip("/") + "/") for t in targets), \
                f"{n}: the model directory is not mounted"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile" and svc["build"]["context"] == "."
    # GPUs: every scatter/combine replica sees all of them and claims a free one (claim-gpu,
    # locks on one shared volume), so replicas of a scaled service never share a GPU.
    claim = ROOT / "docker" / "claim-gpu"
    assert claim.stat().st_mode & 0o111, "docker/claim-gpu must be executable"
    for n, (kind, _) in configs.items():
        svc = compose["services"][n]
        devs = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if kind in ("scatter", "combine"):
            assert devs and all("gpu" in d.get("capabilities", []) for d in devs), n
            assert svc.get("entrypoint") == ["claim-gpu"], f"{n}: claims no GPU"
            mounts = {v["target"]: v["source"] for v in svc["volumes"] if isinstance(v, dict)}
            assert mounts.get("/run/hypic-gpus") == "gpu-locks", f"{n}: no shared GPU locks"
        else:
            assert devs == [] and "entrypoint" not in svc, f"{n} needs no GPU"
    text = DOCKERFILE.read_text()
    assert "nvidia/cuda" in text and "ARG HYPIC_EXTRAS=gpu" in text
    assert "claim-gpu" in text
    assert "requirements/base.txt" in text


def test_mutual_tls_and_keys_come_from_declared_secrets(compose, configs) -> None:
    """Every service serves mutual TLS from /run/secrets (files under ./secrets, never in the
    image); segcache demands client certificates (the writer role is a certificate name), the
    router an API key read from a secret."""
    declared = compose.get("secrets") or {}
    for src in declared.values():
        assert src["file"].startswith("./secrets/"), src
    for name, (kind, cfg) in configs.items():
        mounted = {f"/run/secrets/{m['target']}": m["source"] for m in compose["services"][name]["secrets"]}
        for m in mounted.values():
            assert m in declared, f"{name}: secret {m} is not declared"
        if kind == "front":  # HTTP; a client of the router: its CA and API key from secrets
            assert str(cfg.router_tls_ca) in mounted and cfg.router_api_key[1:] in mounted
            continue
        for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca):
            assert str(path) in mounted, f"{name}: {path} is not a mounted secret"
        assert "key" in mounted[str(cfg.tls_key)] and "cert" in mounted[str(cfg.tls_cert)]
        if kind == "segcache":
            assert cfg.mutual_tls and set(cfg.writer_names.split(",")) == {"scatter", "combine"}
        if kind in ("scatter", "combine"):
            assert mounted[str(cfg.tls_cert)] == f"{kind}-cert", f"{name}: not the {kind} identity"
        if kind == "router":
            assert cfg.api_key and cfg.api_key.startswith("@")
            assert cfg.api_key[1:] in mounted
