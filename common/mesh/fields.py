"""Field metadata of the config dataclasses (read by common.mesh.config): one helper for them all.

    port: int = field(default=50051, metadata=field_help("gRPC port; 0 = ephemeral"))
    tls_ca: Optional[Path] = field(default=None, metadata=field_help("CA bundle", shared_env=True))

Kept apart from common.mesh.config because common.mesh.tls, which config imports, uses it too.
"""
from __future__ import annotations

from typing import Any


def field_help(text: str, **extra: Any) -> dict:
    """The metadata of a config field: its --help line, plus flags such as shared_env=True or
    secret=True (common.mesh.config's docstring says what they do)."""
    return {"help": text, **extra}
