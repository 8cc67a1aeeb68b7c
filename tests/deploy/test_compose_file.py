"""docker-compose.yml, docker-compose.cpu.yml and docker/Dockerfile, checked without a Docker
engine: every command runs a real module, every flag and HYPIC_* variable is a field of that
service's config dataclass (and the whole config actually loads), addresses and ports agree
between services, volumes are declared, GPUs are not shared, healthchecks call hypic.healthcheck
on the service's own port, the entry key and TLS files are declared secrets, the Mooncake master
is opt-in and segcache's --remote-url reaches it, and the CPU override (merged as compose merges
it) keeps every service on its own 127.0.0.1 port of the host network.
`make compose-check` runs the files for real."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from common.mesh.config import load_config
from common.mesh.discovery import parse_target
from tests.support.service_configs import config_flags, service_config
from services.segcache.remote_tier import parse_remote_url

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_COMPOSE = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
MOONCAKE_URL = "mooncake://mooncake-master:50091"  # the value docker-compose.yml documents


# ---- loading and merging as compose does ---------------------------------------------------------
class _Reset:
    """`!reset`: the key is dropped from the merged service."""


class _Override:
    """`!override VALUE`: VALUE replaces the base's instead of merging with it."""

    def __init__(self, value):
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
_ComposeLoader.add_constructor("!override", lambda loader, node: _Override(
    loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node, deep=True) if isinstance(node, yaml.MappingNode)
    else loader.construct_scalar(node)))

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """compose's ${VAR} and ${VAR:-default} (the only forms the files use)."""
    def sub(m: re.Match) -> str:
        return env.get(m.group(1)) or (m.group(2) or "")
    return _VAR.sub(sub, text)


def _interpolate_values(node, env: dict[str, str]):
    """compose interpolates the parsed strings, not the text (an empty value stays a string)."""
    if isinstance(node, dict):
        return {k: _interpolate_values(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_values(v, env) for v in node]
    if isinstance(node, _Override):
        return _Override(_interpolate_values(node.value, env))
    return interpolate(node, env) if isinstance(node, str) else node


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    return _interpolate_values(yaml.load(path.read_text(), Loader=_ComposeLoader), env or {})


_REPLACED = {"command", "entrypoint", "test"}  # sequences an override replaces
_BY_TARGET = {"volumes", "secrets"}  # sequences merged by their target


def _merge(base, over, key: str = ""):
    if isinstance(over, _Override):
        return copy.deepcopy(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = copy.deepcopy(base)
        for k, v in over.items():
            if isinstance(v, _Reset):
                out.pop(k, None)
            else:
                out[k] = _merge(out[k], v, k) if k in out else _merge(None, v, k)
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in _REPLACED:
        if key in _BY_TARGET:
            targets = {_target(x) for x in over}
            return [x for x in base if _target(x) not in targets] + copy.deepcopy(over)
        return copy.deepcopy(base) + [x for x in over if x not in base]
    if isinstance(over, (dict, list)):
        return _merge({} if isinstance(over, dict) else [], over, key) if base is None else copy.deepcopy(over)
    return over


def _target(item) -> str:
    if isinstance(item, dict):
        return item.get("target") or item["source"]
    return str(item).split(":")[1] if ":" in str(item) else str(item)


def merged(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml with docker-compose.cpu.yml on top (`extends` resolved)."""
    base, over = load(COMPOSE, env), load(CPU_COMPOSE, env)
    out = _merge(base, {k: v for k, v in over.items() if k != "services" and not k.startswith("x-")})
    for name, svc in over["services"].items():
        svc = dict(svc)
        ext = svc.pop("extends", None)
        if ext:
            assert ext["file"] == COMPOSE.name, ext
            start = _merge(base["services"][ext["service"]], {})
        else:
            start = base["services"].get(name, {})
        out["services"][name] = _merge(start, svc)
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


def hypic_services(compose: dict) -> dict:
    """The services that run a Hypic module (not the Mooncake master)."""
    return {n: s for n, s in compose["services"].items() if s["command"][:2] == ["python", "-m"]}


def kind_of(svc: dict) -> str:
    cmd = svc["command"]
    assert isinstance(cmd, list) and cmd[:2] == ["python", "-m"], cmd
    module = cmd[2]
    assert module.startswith("services."), module
    return module.split(".")[1]


@pytest.fixture(scope="module")
def configs(compose) -> dict:
    return load_configs(compose)


def load_configs(compose: dict) -> dict:
    """service name -> (kind, loaded config dataclass instance)."""
    out = {}
    for name, svc in hypic_services(compose).items():
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


def test_cpu_override_turns_the_device_tier_off(cpu) -> None:
    (seg,) = [cfg for kind, cfg in load_configs(cpu).values() if kind == "segcache"]
    assert seg.device_bytes == 0
    assert "deploy" not in cpu["services"]["segcache"] or not cpu["services"]["segcache"]["deploy"]


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


@pytest.fixture(scope="module")
def cpu() -> dict:
    return merged()


def test_cpu_override_runs_every_service_on_its_own_loopback_port(cpu) -> None:
    services = cpu["services"]
    cfgs = load_configs(cpu)
    ports: dict[int, str] = {}
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", f"{name}: only the host network (no bridge)"
        assert not svc.get("ports"), f"{name}: nothing is published on the host network"
        assert svc["image"] == "hypic-cpu:latest" and svc["build"]["args"]["HYPIC_EXTRAS"] == ""
        assert "devices" not in str(svc.get("deploy", {})), f"{name}: a GPU reservation left"
        assert svc.get("entrypoint") in (None, []), f"{name}: claims a GPU"
        assert all("gpu-locks" not in str(v) for v in svc.get("volumes") or []), name
    for name, (kind, cfg) in cfgs.items():
        assert cfg.host == "127.0.0.1", f"{name} must listen on loopback only"
        assert cfg.port not in ports, f"{name} and {ports.get(cfg.port)} share port {cfg.port}"
        ports[cfg.port] = name
        if getattr(cfg, "metrics_port", -1) >= 0:
            assert cfg.metrics_port not in ports, name
            ports[cfg.metrics_port] = name + " metrics"
        test = services[name]["healthcheck"]["test"]
        assert split(test[4]) == ("127.0.0.1", cfg.port), (name, test)
        if kind in ("scatter", "combine"):
            assert cfg.device == "cpu" and str(cfg.dtype).endswith("float32"), name
            assert str(cfg.model).startswith("/models/")
    master = dict(a.split("=", 1) for a in services["mooncake-master"]["command"][1:])
    assert master["--rpc_address"] == "127.0.0.1" and master["--metrics_host"] == "127.0.0.1"
    for flag in ("--rpc_port", "--metrics_port"):
        assert int(master[flag]) not in ports, f"mooncake-master {flag} is taken"
        ports[int(master[flag])] = "mooncake-master"
    assert all(p < 32768 for p in ports), "ports inside Linux's ephemeral range can be taken"


def test_cpu_override_router_lists_every_worker(cpu) -> None:
    """No compose DNS on the host network: the router's static lists name every scatter and
    combine service, by the port each listens on, and the segcache they all use."""
    cfgs = load_configs(cpu)
    by_kind: dict[str, set[str]] = {}
    for name, (kind, cfg) in cfgs.items():
        by_kind.setdefault(kind, set()).add(f"127.0.0.1:{cfg.port}")
    (router,) = [cfg for kind, cfg in cfgs.values() if kind == "router"]
    assert len(by_kind["scatter"]) >= 2, "the crash check needs a second scatter"
    assert set(router.scatter_addresses.split(",")) == by_kind["scatter"]
    assert set(router.combine_addresses.split(",")) == by_kind["combine"]
    assert {router.segcache_address} == by_kind["segcache"]
    for name, (kind, cfg) in cfgs.items():
        if kind in ("scatter", "combine"):
            assert cfg.segcache_address == router.segcache_address, name
            assert cfg.dtype == router.dtype, f"{name}: dtype differs from the router's"
        if kind == "front":
            assert cfg.routers == [router.host + f":{router.port}"]
    deps = cpu["services"]["router"]["depends_on"]
    assert {n for n, (k, _) in cfgs.items() if k in ("scatter", "combine", "segcache")} <= set(deps)
    on = merged({"HYPIC_REMOTE_URL": "mooncake://127.0.0.1:23091"})
    master = dict(a.split("=", 1) for a in on["services"]["mooncake-master"]["command"][1:])
    (seg,) = [cfg for kind, cfg in load_configs(on).values() if kind == "segcache"]
    assert parse_remote_url(seg.remote_url) == ("127.0.0.1", int(master["--rpc_port"]))
    assert "mooncake://127.0.0.1:23091" in CPU_COMPOSE.read_text()


def test_cpu_override_keeps_secrets_and_entry_key(cpu) -> None:
    for name, (kind, cfg) in load_configs(cpu).items():
        mounted = {f"/run/secrets/{m['target']}": m["source"] for m in cpu["services"][name]["secrets"]}
        if kind in ("segcache", "scatter", "combine"):
            assert mounted[str(cfg.entry_key_file)] == "entry-key", name
        if kind in ("scatter", "combine"):
            assert mounted[str(cfg.tls_cert)] == f"{kind}-cert", f"{name}: not the {kind} identity"


def test_merge_follows_compose_rules() -> None:
    """The helper above against the rules the files rely on (compose-spec merge)."""
    base = {"command": ["a", "b"], "environment": {"X": "1", "Y": "2"}, "deploy": {"r": 1},
            "volumes": [{"type": "bind", "source": "./m", "target": "/m"}, "v:/data"],
            "ports": ["1:1"]}
    over = {"command": ["c"], "environment": {"Y": "3"}, "deploy": _Reset(),
            "volumes": [{"type": "bind", "source": "./n", "target": "/m"}], "ports": _Override([])}
    got = _merge(base, over)
    assert got == {"command": ["c"], "environment": {"X": "1", "Y": "3"},
                   "volumes": ["v:/data", {"type": "bind", "source": "./n", "target": "/m"}],
                   "ports": []}
    assert interpolate("a ${X:-d} ${Y:-} ${Z}", {"X": "x"}) == "a x  "


def test_cpu_image_leaves_out_only_what_services_never_import(cpu) -> None:
    """PIP_SKIP (the CPU image's left-out requirements) must name no runtime dependency of the
    package and nothing the services, common/ or the SDK import."""
    import tomllib

    skip = cpu["services"]["segcache"]["build"]["args"].get("PIP_SKIP", "")
    names = {n.strip().lower() for n in skip.split("|") if n.strip()}
    assert names, "the CPU image skips nothing: PIP_SKIP lost?"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    runtime = {re.split(r"[=<>~!;\[ ]", d, maxsplit=1)[0].strip().lower() for d in deps}
    assert not names & runtime, f"PIP_SKIP drops runtime dependencies {names & runtime}"
    modules = {n.replace("-", "_") for n in names}
    imports = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(sorted(modules)) + r")\b", re.M)
    for pkg in ("services", "common", "hypic"):
        for f in (ROOT / pkg).rglob("*.py"):
            hit = imports.search(f.read_text())
            assert hit is None, f"{f.relative_to(ROOT)} imports {hit.group(1)}, left out of the CPU image"
    text = DOCKERFILE.read_text()
    assert "ARG PIP_SKIP=" in text and "${PIP_SKIP}" in text


def test_the_cpu_image_build_and_the_check(cpu) -> None:
    for name, svc in cpu["services"].items():
        b = svc["build"]
        assert svc["image"] == "hypic-cpu:latest" and b["network"] == "host", name
        assert b["args"]["HYPIC_EXTRAS"] == "", f"{name}: no GPU extra on CPU"
        assert "constraints-cpu.txt" in b["args"]["PIP_CONSTRAINTS"]
        assert (ROOT / b["args"]["PIP_CONSTRAINTS"].split()[-1]).is_file()
    text = DOCKERFILE.read_text()
    assert "${PIP_CONSTRAINTS}" in text and "ARG CUDA_IMAGE" in text
    check = ROOT / "scripts" / "compose-check.sh"
    assert check.stat().st_mode & 0o111
    assert "compose-check:" in (ROOT / "Makefile").read_text()
    assert "--profile mooncake" in check.read_text() and "scripts/compose_request.py" in check.read_text()
