"""The committed generated modules match what protos/generate.py produces from protos/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("hypic_protos_generate", REPO / "protos" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.processes  # runs protos/generate.py
def test_generated_code_in_sync(tmp_path: Path) -> None:
    gen = _load_generator()
    assert gen.proto_files(), "no .proto files found under protos/"
    outputs = gen.generate(tmp_path)
    stale = []
    for rel in outputs:
        fresh = (tmp_path / rel).read_bytes()
        committed = REPO / rel
        if not committed.exists() or committed.read_bytes() != fresh:
            stale.append(str(rel))
    assert not stale, f"generated code out of date, run `python protos/generate.py`: {stale}"


def test_grpc_tools_matches_generated_version() -> None:
    grpc_tools = pytest.importorskip("grpc_tools")
    del grpc_tools
    from importlib.metadata import version

    tools = version("grpcio-tools")
    generated = sorted((REPO / "protos").rglob("*_pb2_grpc.py"))
    assert generated, "no generated *_pb2_grpc.py under protos/"
    for path in generated:
        text = path.read_text()
        assert f"GRPC_GENERATED_VERSION = '{tools}'" in text, (path, tools)


def test_generated_modules_import() -> None:
    sys.path.insert(0, str(REPO))
    from protos.hypic.v1 import segcache_pb2 as segcache_pb, segcache_pb2_grpc as segcache_grpc

    assert segcache_pb.DESCRIPTOR.package == "hypic.v1"
    assert hasattr(segcache_grpc, "SegcacheStub")
