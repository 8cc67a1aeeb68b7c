"""docker-compose.cpu.yml merged onto docker-compose.yml as compose merges it, checked without a
Docker engine: every service on its own 127.0.0.1 port of the host network, the router listing
every worker, secrets and the entry key kept, no GPU and no device tier, and the CPU image leaving
out only what the services never import."""

from __future__ import annotations

import re

import pytest

from services.segcache.remote_tier import parse_remote_url
from tests.support.compose_files import (CPU_COMPOSE, DOCKERFILE, ROOT, _merge, _Override, _Reset, interpolate,
                                        load_configs, merged, split)


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


def test_cpu_override_turns_the_device_tier_off(cpu) -> None:
    (seg,) = [cfg for kind, cfg in load_configs(cpu).values() if kind == "segcache"]
    assert seg.device_bytes == 0
    assert "deploy" not in cpu["services"]["segcache"] or not cpu["services"]["segcache"]["deploy"]
