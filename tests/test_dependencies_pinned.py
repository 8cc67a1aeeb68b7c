"""pyproject.toml declares the dependencies (base and extras) and requirements/ pins them: every
declared package has an exact pin (`==`) in requirements/base.txt (the [gpu] extra in
constraints-gpu.txt, installed only on GPU machines), and every package base.txt pins is declared,
so `pip install .` gives a package that can start its own mesh and the pins cover all of it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(spec: str) -> str:
    m = NAME.match(spec)
    assert m, spec
    return _norm(m.group(1))


def _pins(path: Path) -> dict[str, str]:
    """name -> the line of each requirement in a requirements file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out[_name(line)] = line
    return out


def _declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {"": {_name(d) for d in project["dependencies"]}}
    out.update({k: {_name(d) for d in v} for k, v in project["optional-dependencies"].items()})
    return out


def test_every_declared_dependency_is_pinned() -> None:
    base = _pins(ROOT / "requirements" / "base.txt")
    gpu = _pins(ROOT / "requirements" / "constraints-gpu.txt")
    declared = _declared()
    for extra, names in declared.items():
        pins = gpu if extra == "gpu" else base
        missing = sorted(n for n in names if n not in pins)
        assert missing == [], f"[{extra or 'base'}] declared but not pinned: {missing}"
        loose = sorted(pins[n] for n in names if "==" not in pins[n])
        assert loose == [], f"[{extra or 'base'}] not pinned exactly: {loose}"


def test_every_pin_is_declared() -> None:
    declared = set().union(*_declared().values())
    undeclared = sorted(set(_pins(ROOT / "requirements" / "base.txt")) - declared)
    assert undeclared == [], f"pinned in requirements/base.txt, not declared in pyproject.toml: {undeclared}"
    gpu_extra = _declared()["gpu"]
    assert set(_pins(ROOT / "requirements" / "constraints-gpu.txt")) - {"torch"} == gpu_extra


def test_the_mesh_packages_are_base_dependencies() -> None:
    """What the issue found missing: `pip install .` must bring nixl and triton (and the health
    service the launcher probes); mooncake is the [mooncake] extra."""
    declared = _declared()
    assert {"nixl", "triton", "grpcio-health-checking", "xxhash"} <= declared[""]
    assert "mooncake-transfer-engine-non-cuda" in declared["mooncake"]
