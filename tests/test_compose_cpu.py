"""docker-compose.cpu.yml over docker-compose.yml, checked without a Docker engine (the real
run is `make compose-check`): merged the way compose merges them, every service runs on the
host network on its own 127.0.0.1 port, the router's static lists reach them, nothing asks for
a GPU or publishes a port, the config of each service loads (CPU, float32 everywhere), and the
image is built for CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.rpc.config import load_config
from service_configs import service_config

ROOT = Path(__file__).resolve().parent.parent


class Reset:
    """compose's `!reset`: the key goes back to its default (absent)."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def merge(base, over):
    """compose's override rules, as far as these files use them: mappings merge key by key,
    `command`/`entrypoint`/`test` and other lists are replaced, !reset removes the key."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = merge(base.get(k), v)
        return out
    return over


@pytest.fixture(scope="module")
def merged() -> dict:
    base = yaml.load((ROOT / "docker-compose.yml").read_text(), Loader=ComposeLoader)
    cpu = yaml.load((ROOT / "docker-compose.cpu.yml").read_text(), Loader=ComposeLoader)
    assert set(cpu["services"]) <= set(base["services"]), "the override adds no service"
    return merge(base, cpu)


def configs(merged: dict) -> dict:
    out = {}
    for name, svc in merged["services"].items():
        kind = svc["command"][2].split(".")[1]
        cls, prefix = service_config(kind)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        out[name] = (kind, load_config(cls, svc["command"][3:], env=env, env_prefix=prefix))
    return out


def test_host_network_on_distinct_loopback_ports(merged) -> None:
    cfgs = configs(merged)
    ports = {}
    for name, svc in merged["services"].items():
        kind, cfg = cfgs[name]
        assert svc.get("network_mode") == "host", name
        assert "ports" not in svc, f"{name}: nothing is published on the host network"
        assert cfg.host == "127.0.0.1" and 1024 < cfg.port < 32768, (name, cfg.port)
        assert getattr(cfg, "metrics_port", -1) == -1, f"{name}: metrics ports would collide"
        assert cfg.port not in ports.values(), f"{name}: port {cfg.port} taken"
        ports[name] = cfg.port
        assert svc["healthcheck"]["test"][4] == f"127.0.0.1:{cfg.port}", name
        assert "deploy" not in svc, f"{name}: no GPU reservation, no replicas on CPU"
        if kind in ("scatter", "combine"):
            assert cfg.device == "cpu" and cfg.dtype == "float32"
            assert svc["environment"]["HYPIC_CLAIM_GPU"] == "0"
            assert cfg.segcache_address == f"127.0.0.1:{ports.get('segcache')}"
    _, router = cfgs["router"]
    assert router.dtype == "float32"
    assert router.segcache_address == f"127.0.0.1:{ports['segcache']}"
    assert router.scatters == [f"127.0.0.1:{ports['scatter']}"]
    assert router.combines == [f"127.0.0.1:{ports['combine']}"]
    if "front" in cfgs:
        assert cfgs["front"][1].routers == [f"127.0.0.1:{ports['router']}"]


def test_the_cpu_image_build(merged) -> None:
    for name, svc in merged["services"].items():
        b = svc["build"]
        assert svc["image"] == "hypic-cpu:latest" and b["network"] == "host", name
        assert b["args"]["HYPIC_EXTRAS"] == "", f"{name}: no GPU extra on CPU"
        assert "constraints-cpu.txt" in b["args"]["PIP_CONSTRAINTS"]
        assert (ROOT / b["args"]["PIP_CONSTRAINTS"].split()[-1]).is_file()
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "${PIP_CONSTRAINTS}" in text and "ARG CUDA_IMAGE" in text
    check = ROOT / "scripts" / "compose-check.sh"
    assert check.stat().st_mode & 0o111
    assert "compose-check:" in (ROOT / "Makefile").read_text()
