"""Each service's config dataclass, looked up by kind (tests only: the SDK's launcher spawns
`python -m services.<kind>` and never imports a service)."""
from __future__ import annotations

import dataclasses
import importlib


def service_config(kind: str) -> tuple[type, str]:
    """(config dataclass, env prefix) of `services.<kind>`: the dataclass in
    services/<kind>/config.py whose name ends with "Config"."""
    mod = importlib.import_module(f"services.{kind}.config")
    prefix = getattr(mod, "ENV_PREFIX", f"HYPIC_{kind.upper()}_")
    for name, obj in vars(mod).items():
        if (name.endswith("Config") and dataclasses.is_dataclass(obj) and isinstance(obj, type)
                and obj.__module__ == mod.__name__):
            return obj, prefix
    raise LookupError(f"no *Config dataclass in services/{kind}/config.py")


def config_flags(kind: str) -> set[str]:
    """Every `--flag` the service accepts (its config fields, plus --no-x for bools)."""
    cls, _ = service_config(kind)
    flags = set()
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        flags.add(flag)
        flags.add("--no-" + f.name.replace("_", "-"))
    return flags
