"""The compose files as the deploy tests read them, without a Docker engine: loaded with compose's
variable interpolation, and the CPU override merged onto docker-compose.yml as compose merges it."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from common.mesh.config import load_config
from tests.support.service_configs import service_config

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


def hypic_services(compose: dict) -> dict:
    """The services that run a Hypic module (not the Mooncake master)."""
    return {n: s for n, s in compose["services"].items() if s["command"][:2] == ["python", "-m"]}


def kind_of(svc: dict) -> str:
    cmd = svc["command"]
    assert isinstance(cmd, list) and cmd[:2] == ["python", "-m"], cmd
    module = cmd[2]
    assert module.startswith("services."), module
    return module.split(".")[1]


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
