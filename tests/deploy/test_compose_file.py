"""docker-compose.yml, docker-compose.cpu.yml and docker/Dockerfile, checked without a Docker
engine: every command runs a real module, every flag and HYPIC_* variable is a field of that
service's config dataclass (and the whole config actually loads), addresses and ports agree
between services, volumes are declared, GPUs are not shared, healthchecks call hypic.healthcheck
on the service's own port, the entry key and TLS files are declared secrets, the Mooncake master
is opt-in and segcache's --remote-url reaches it, and the CPU override (merged as compose merges
it) keeps every service on its own 127.0.0.1 port of the host network.
`make compose-check` runs the files for real."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from common.mesh.discovery import parse_target
from tests.support.compose_files import (COMPOSE, DOCKERFILE, MOONCAKE_URL, ROOT, hypic_services, kind_of, load,
                                        load_configs, split)
from tests.support.service_configs import config_flags, service_config
from services.segcache.remote_tier import parse_remote_url

@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def configs(compose) -> dict:
    return load_configs(compose)


def test_every_command_is_a_real_module(compose) -> None:
    kinds = set()
    for name, svc in hypic_services(compose).items():
        module = svc["command"][2]
        assert importlib.util.find_spec(module + ".__main__") is not None, f"{name}: {module}"
        kinds.add(kind_of(svc))
    assert kinds == {"segcache", "scatter", "combine", "router", "front"}


def test_flags_and_env_vars_are_config_fields(compose, configs) -> None:
    for name, svc in hypic_services(compose).items():
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
                   for a in test[5:] if a not in ("--http", "--https"))
        assert ("--http" in test) == (k == "front"), f"{n}: HTTP probe only for the front"
        for dep in services[n].get("depends_on") or {}:
            assert dep in services, f"{n} depends on unknown {dep}"
        for mapping in services[n].get("ports") or []:
            assert int(str(mapping).split(":")[-1]) == cfg.port, (n, mapping)
    published = [n for n, s in services.items() if s.get("ports")]
    assert published == routers + fronts, "only the router and the front are published"


def test_volumes_gpus_and_image(compose, configs) -> None:
    declared = set(compose.get("volumes") or {})
    for n, svc in hypic_services(compose).items():
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
        elif kind == "segcache":  # its device tier: one fixed GPU, shared (test_segcache_device_tier_...)
            assert [d.get("device_ids") for d in devs] == [["0"]] and "entrypoint" not in svc, n
        else:
            assert devs == [] and "entrypoint" not in svc, f"{n} needs no GPU"
    text = DOCKERFILE.read_text()
    assert "nvidia/cuda" in text and "ARG HYPIC_EXTRAS=gpu" in text
    assert "claim-gpu" in text
    assert "requirements/base.txt" in text


def test_segcache_device_tier_on_the_gpu_a_combine_claims_first(compose, configs) -> None:
    """Tier 0 is on (--device-bytes), on the one GPU segcache reserves, within a budget that leaves
    that GPU room for the combine's model; the combine starts before any scatter, so its claim
    (claim-gpu: the lowest free GPU) is GPU 0, where a hit can reach it without a host round trip."""
    (name,) = [n for n, (k, _) in configs.items() if k == "segcache"]
    cfg = configs[name][1]
    svc = compose["services"][name]
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["device_ids"] == ["0"] and "gpu" in dev["capabilities"] and "count" not in dev
    assert cfg.device_index == 0  # the only GPU the container sees
    assert 1 << 30 <= cfg.device_bytes <= 32 << 30, "tier 0 must leave an 80 GB GPU room for a model"
    for n, (kind, _) in configs.items():
        if kind == "scatter":
            deps = compose["services"][n]["depends_on"]
            combines = [c for c, (k, _) in configs.items() if k == "combine"]
            assert combines and all(deps.get(c, {}).get("condition") == "service_started" for c in combines), n
    assert "HYPIC_SEGCACHE_DEVICE_BYTES" in (ROOT / "docs" / "deploy.md").read_text()


def test_combines_share_segcache_ipc_and_pid_namespaces(compose, configs) -> None:
    """CUDA IPC between containers (a tier-0 hit mapped by the combine on segcache's GPU) needs
    both processes in one IPC and one PID namespace: segcache's is shareable and every combine
    joins it; no scatter needs it."""
    (seg,) = [n for n, (k, _) in configs.items() if k == "segcache"]
    assert compose["services"][seg].get("ipc") == "shareable"
    for n, (kind, _) in configs.items():
        svc = compose["services"][n]
        if kind == "combine":
            assert svc.get("ipc") == svc.get("pid") == f"service:{seg}", n
        elif kind == "scatter":
            assert "ipc" not in svc and "pid" not in svc, n


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
        for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca):
            assert str(path) in mounted, f"{name}: {path} is not a mounted secret"
        assert "key" in mounted[str(cfg.tls_key)] and "cert" in mounted[str(cfg.tls_cert)]
        if kind == "front":  # HTTPS; an mTLS client of the router (its own identity) with the API key
            assert cfg.https and str(cfg.routers_ca) in mounted and cfg.router_api_key[1:] in mounted
            assert mounted[str(cfg.tls_cert)] == "front-cert", f"{name}: not the front's identity"
            test = compose["services"][name]["healthcheck"]["test"]
            assert "--https" in test, f"{name}: its healthcheck speaks plain HTTP to an HTTPS port"
            continue
        if kind == "segcache":
            assert cfg.mutual_tls and set(cfg.writer_names.split(",")) == {"scatter", "combine"}
        if kind in ("scatter", "combine"):
            assert mounted[str(cfg.tls_cert)] == f"{kind}-cert", f"{name}: not the {kind} identity"
        if kind == "router":
            assert cfg.api_key and cfg.api_key.startswith("@")
            assert cfg.api_key[1:] in mounted


def test_one_entry_key_for_every_entry_writer_and_reader(compose, configs) -> None:
    """scatter and combine seal and open entries, segcache checks every Put: all three read the
    same declared secret (./secrets/entry-key), never a file baked into the image."""
    declared = compose.get("secrets") or {}
    sources = set()
    for name, (kind, cfg) in configs.items():
        mounted = {f"/run/secrets/{m['target']}": m["source"] for m in compose["services"][name]["secrets"]}
        if kind in ("segcache", "scatter", "combine"):
            assert cfg.entry_key_file is not None, f"{name}: no entry key (entries unsealed)"
            assert str(cfg.entry_key_file) in mounted, f"{name}: {cfg.entry_key_file} is not a secret"
            sources.add(mounted[str(cfg.entry_key_file)])
        else:
            assert "entry-key" not in mounted.values(), f"{name} needs no entry key"
    assert len(sources) == 1, f"one entry key for the mesh, not {sources}"
    assert declared[sources.pop()]["file"] == "./secrets/entry-key"


def test_mooncake_master_is_opt_in_and_reached_by_segcache() -> None:
    off = load(COMPOSE)
    master = off["services"]["mooncake-master"]
    assert master.get("profiles") == ["mooncake"], "the master must be off by default"
    assert not master.get("ports"), "the master is not published"
    assert master["command"][0] == "mooncake_master"
    seg = [n for n, (k, _) in load_configs(off).items() if k == "segcache"]
    assert seg and all(load_configs(off)[n][1].remote_url == "" for n in seg), "tier on by default"

    on = load(COMPOSE, {"HYPIC_REMOTE_URL": MOONCAKE_URL})
    assert MOONCAKE_URL in COMPOSE.read_text(), "the documented URL changed: update MOONCAKE_URL"
    flags = dict(a.split("=", 1) for a in on["services"]["mooncake-master"]["command"][1:])
    for n, (kind, cfg) in load_configs(on).items():
        if kind == "segcache":
            host, port = parse_remote_url(cfg.remote_url)
            assert host == "mooncake-master" and port == int(flags["--rpc_port"]), cfg.remote_url
    probe = " ".join(master["healthcheck"]["test"])
    assert f"'127.0.0.1', {flags['--rpc_port']}" in probe, "the probe must knock on the RPC port"
    # the master runs from the Hypic image: the libraries the wheel's binaries link against
    # (undeclared by the wheel; without them mooncake_master does not start)
    text = DOCKERFILE.read_text()
    for lib in ("libibverbs1", "libcurl4", "libnuma1"):
        assert lib in text, f"docker/Dockerfile lacks {lib}"
    assert "mooncake.store" in text, "the image build must import mooncake.store"

