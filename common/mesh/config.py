"""Typed configuration dataclasses from CLI flags and environment variables.

    @dataclass
    class MyConfig:
        port: int = field(default=50051, metadata={"help": "gRPC port; 0 = ephemeral"})
        data_dir: Path = Path("data")
        verbose: bool = False

    cfg = load_config(MyConfig, sys.argv[1:], env_prefix="HYPIC_MYSERVICE_")

Each field `some_name` becomes the flag `--some-name` and the environment variable
`<env_prefix>SOME_NAME`. Precedence: flag > environment > dataclass default. Supported field
types: int, float, bool, str, Path and Optional[...] of those (an empty string or "none" gives
None). Ints accept underscores and binary/decimal size suffixes ("64MiB", "2G", "512k").
Bools accept 1/0, true/false, yes/no, on/off; as flags, `--name` / `--no-name`.
Field metadata: `shared_env=True` also reads `HYPIC_<NAME>` when the service's own variable is
unset (one TLS CA or token for the whole mesh); `secret=True` is redacted by describe().
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, TypeVar

from common.engine.dtypes import (
    DTYPE_NAMES, ENTRY_FORMATS, WORKER_ENTRY_FORMAT, check_dtype_name, check_entry_format,
)
from common.mesh.fields import field_help
from common.mesh.tls import TlsConfig

T = TypeVar("T")
SHARED_ENV_PREFIX = "HYPIC_"  # fields with metadata shared_env=True also read HYPIC_<NAME>

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_INT_RE = re.compile(r"^\s*([+-]?[0-9][0-9_]*)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class ConfigError(ValueError):
    """A flag or environment variable could not be parsed, or a value is invalid."""


def parse_int(text: str) -> int:
    """Parse an int with optional underscores and size suffix: '4096', '1_000', '64MiB', '2G'."""
    m = _INT_RE.match(text)
    if not m:
        raise ValueError(f"not an integer: {text!r}")
    unit = m.group(2).lower()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size suffix {m.group(2)!r} in {text!r}")
    return int(m.group(1).replace("_", "")) * _SIZE_UNITS[unit]


def parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


_PARSERS: dict[type, Callable[[str], Any]] = {
    int: parse_int,
    float: float,
    bool: parse_bool,
    str: str,
    Path: Path,
}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {tp!r}")
    return tp, False


def _parser_for(tp: Any) -> tuple[Callable[[str], Any], type, bool]:
    base, optional = _unwrap_optional(tp)
    if base not in _PARSERS:
        raise TypeError(f"unsupported config field type {tp!r}")
    parse = _PARSERS[base]
    if optional:
        def parse_optional(text: str, _p=parse) -> Any:
            return None if text.strip().lower() in ("", "none", "null") else _p(text)
        return parse_optional, base, True
    return parse, base, False


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}{field_name.upper()}"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser(cls: type, *, env_prefix: str = "HYPIC_", prog: str | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser whose every option defaults to 'not given' (so env can fill in)."""
    hints = typing.get_type_hints(cls)
    ap = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip(),
                                 argument_default=argparse.SUPPRESS)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        parse, base, _ = _parser_for(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        env_help = env_name(env_prefix, f.name) + (
            f" or {env_name(SHARED_ENV_PREFIX, f.name)}" if f.metadata.get("shared_env") else "")
        help_text = f"{help_text} [env {env_help}; default {default!r}]".strip()
        if base is bool:
            ap.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                            help=help_text)
        else:
            def _type(text: str, _p=parse, _n=f.name) -> Any:
                try:
                    return _p(text)
                except ValueError as e:
                    raise argparse.ArgumentTypeError(f"{_n}: {e}") from None
            _type.__name__ = base.__name__
            ap.add_argument(flag_name(f.name), dest=f.name, type=_type, metavar=base.__name__.upper(),
                            help=help_text)
    return ap


def load_config(cls: type[T], argv: Sequence[str] | None = None, *,
                env: Mapping[str, str] | None = None, env_prefix: str = "HYPIC_",
                prog: str | None = None) -> T:
    """Build `cls` (a dataclass) from flags (argv), then env vars, then the field defaults.

    argv=None reads no flags (pass sys.argv[1:] explicitly); env=None reads os.environ.
    Unknown flags exit with status 2 (argparse); an unparsable env var raises ConfigError.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    ap = build_parser(cls, env_prefix=env_prefix, prog=prog)
    given = vars(ap.parse_args(list(argv) if argv is not None else []))
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in given:
            kwargs[f.name] = given[f.name]
            continue
        name = env_name(env_prefix, f.name)
        if name not in env and f.metadata.get("shared_env"):
            name = env_name(SHARED_ENV_PREFIX, f.name)  # one value for the whole mesh
        if name in env:
            parse, _, _ = _parser_for(hints[f.name])
            try:
                kwargs[f.name] = parse(env[name])
            except ValueError as e:
                raise ConfigError(f"environment variable {name}={env[name]!r}: {e}") from None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


OTLP_HELP = ("OpenTelemetry collector (OTLP/gRPC, e.g. http://127.0.0.1:4317) to send this "
             "service's trace spans to; empty = OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off "
             "(common/mesh/tracing.py)")
DRAIN_HELP = ("on SIGTERM: seconds to keep serving while health says NOT_SERVING, so load balancers "
              "and the router stop sending first; then stop (a second signal cuts it short)")


@dataclasses.dataclass
class ServiceConfig(TlsConfig):
    """What every service's config shares (its base class): the TLS fields (common.mesh.tls), the
    metrics, log and drain fields (their flags come first in --help) and the checks of the server
    fields each config declares with its own defaults (port, port_file, max_message_bytes)."""

    metrics_port: int = dataclasses.field(default=-1, metadata={"help": "Prometheus port; -1 = off, 0 = ephemeral"})
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "Prometheus bind address"})
    log_level: str = dataclasses.field(default="info", metadata={"help": "debug | info | warning | error"})
    log_json: bool = dataclasses.field(default=True, metadata={"help": "JSON log lines (else console format)"})
    drain_s: float = dataclasses.field(default=0.0, metadata={"help": DRAIN_HELP})
    otlp_endpoint: str = dataclasses.field(default="", metadata=field_help(
        OTLP_HELP, shared_env=True))

    def check_server(self) -> None:
        """port in range, port_file a Path, max_message_bytes >= 64 KiB, drain_s finite >= 0
        (ValueError otherwise)."""
        if not (self.drain_s >= 0 and self.drain_s < float("inf")):
            raise ValueError(f"drain_s must be a finite number >= 0, not {self.drain_s!r}")
        self.check_tls()
        port_file = getattr(self, "port_file", None)
        if port_file is not None:
            self.port_file = Path(port_file)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_message_bytes < 64 * 1024:
            raise ValueError("max_message_bytes must be at least 64 KiB")



ENTRY_KEY_HELP = (
    "file holding the mesh's entry secret (the same for segcache, scatter and combine): entries "
    "are sealed with it and refused unless they open under it (common/engine/pic/seal.py); none = an "
    "unkeyed seal, which binds an entry's header to its tensors but does not stop forgery")


@dataclasses.dataclass
class WorkerConfig(ServiceConfig):
    """What the processes that load the model (scatter, combine) share: the model, its dtype,
    device and threads, and the entry key; each worker's config extends it and calls
    check_worker() in its __post_init__. ENV_PREFIX names the worker's variables in errors."""

    ENV_PREFIX: ClassVar[str] = "HYPIC_"

    model: Optional[Path] = dataclasses.field(default=None, metadata=field_help("checkpoint directory (required)"))
    dtype: str = dataclasses.field(default="float32", metadata=field_help(" | ".join(DTYPE_NAMES)))
    device: str = dataclasses.field(default="cpu", metadata=field_help("torch device of the model"))
    threads: int = dataclasses.field(default=0, metadata=field_help("torch intra-op threads; 0 = torch's default"))
    entry_key_file: Optional[Path] = dataclasses.field(default=None, metadata=field_help(ENTRY_KEY_HELP))
    entry_format: str = dataclasses.field(default=WORKER_ENTRY_FORMAT, metadata=field_help(
        "storage of entries' T and S (fp8t: T fp8, S bf16; fp8: attention K/V too, common/engine/pic/compact.py): "
        + " | ".join(ENTRY_FORMATS) + " (every worker of a mesh the same; a combine "
        "rounds an fp32 entry to its format and rebuilds an entry of another compact format itself)"))

    def check_worker(self) -> None:
        """check_server(), then: a model given (as a Path), a served dtype, threads >= 0
        (ValueError otherwise)."""
        self.check_server()
        if self.model is None:
            raise ValueError(f"--model ({self.ENV_PREFIX}MODEL) is required")
        self.model = Path(self.model)
        check_dtype_name(self.dtype)
        check_entry_format(self.entry_format)
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.entry_key_file is not None:
            self.entry_key_file = Path(self.entry_key_file)

def describe(cfg: Any) -> dict[str, Any]:
    """The config as a JSON-friendly dict (Paths as strings), for the startup log line."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.metadata.get("secret") and v is not None:
            v = "<redacted>"
        out[f.name] = str(v) if isinstance(v, Path) else v
    return out
