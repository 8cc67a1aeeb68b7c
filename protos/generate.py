"""Regenerate the Python modules of every .proto under protos/.

    python protos/generate.py            # writes beside the .proto files (protos/hypic/v1/)
    python protos/generate.py --out DIR  # writes under DIR/protos/... (the in-sync test uses this)

The generated modules form the `protos` package (`from protos.hypic.v1 import segcache_pb2`),
which services, common/mesh and the SDK all import; no process needs another's package for it.
Protos are compiled from the repository root, so their own imports read
`import "protos/hypic/v1/router.proto"`. Equivalent to, for each file:
    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. FILE

The generated code embeds the grpcio-tools version; regenerate with the pinned version
(requirements/base.txt) so tests/test_protos_in_sync.py stays green.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under root, relative to the repository root, in a stable order."""
    return sorted(p.relative_to(REPO_ROOT) for p in root.rglob("*.proto"))


def generate(out_dir: Path = REPO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every .proto under root; return the relative paths of the outputs."""
    import grpc_tools

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files(grpc_tools) / "_proto")
    files = proto_files(root)
    outputs: list[Path] = []
    for rel in files:
        # protoc runs in a child process: loading grpc_tools' compiler into a process that
        # already holds another libprotobuf (torch, nixl) can crash it.
        args = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / rel),
        ]
        proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"protoc failed ({proc.returncode}) on {rel}: {proc.stderr}")
        stem = rel.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            outputs.append(stem.parent / (stem.name + suffix))
    return outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo root)")
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
