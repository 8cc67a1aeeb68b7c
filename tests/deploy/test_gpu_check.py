"""scripts/gpu_check.py without a GPU: the table's plumbing, and the tiny checkpoints it builds.

The GPU rows themselves only run on a machine with NVIDIA GPUs (`make gpu-check`, docs/gpu.md);
here every one of them must be reported as skipped, with the reason, and nothing may fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_mid  # noqa: E402
import gpu_tier  # noqa: E402

# engine per model family, seven other checks, four mid-size model rows, fla vs torch per kernel family
N_ROWS = 3 + 7 + 4 + 6
TINY_SPEC = "hidden=128,layers=4,ratio=3:1,vocab=512"  # bench.random_model's pattern, at a CPU size


@pytest.mark.processes
def test_dry_run_prints_every_row_skipped(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == N_ROWS
    assert {r["status"] for r in rows} == {"skip"}
    assert all("dry run" in r["detail"] for r in rows)
    for r in rows:  # one table line per row, with its reason
        assert any(line.startswith(r["check"]) and "skip" in line for line in proc.stdout.splitlines())


def test_without_cuda_each_row_says_what_is_missing():
    """Probing for real on this CPU machine: CUDA is missing (and fla, which must not be in .venv)."""
    rows = gpu_check.run_rows(dry_run=False)
    assert len(rows) == N_ROWS and {r.status for r in rows} == {"skip"}
    assert all("no CUDA device" in r.detail for r in rows)
    fla_rows = [r for r in rows if r.check.startswith("fla path")]
    assert len(fla_rows) == 6 and all("fla" in r.detail.split("cuda:")[-1] for r in fla_rows)
    assert "fla" not in sys.modules


def test_budget_skips_rows_that_would_start_late(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "probe", lambda dry: {k: None for k in ("cuda", "fla", "triton", "nixl", "model")})
    monkeypatch.setattr(gpu_check, "plan", lambda tmp: [
        ("first", ("cuda",), lambda: calls.append(1) or ("ok", "1", "")),
        ("broken", ("cuda",), lambda: 1 / 0),
        ("late", ("cuda",), lambda: calls.append(2) or ("ok", "2", "")),
    ])
    rows = gpu_check.run_rows(dry_run=False, budget_s=-1.0)
    assert [r.status for r in rows] == ["skip"] * 3 and not calls
    rows = gpu_check.run_rows(dry_run=False, budget_s=600)
    assert [r.status for r in rows] == ["ok", "FAIL", "ok"] and "ZeroDivisionError" in rows[1].detail
    assert "FAIL" in gpu_check.table(rows)


@pytest.mark.parametrize("family, kinds", [("gated_deltanet", "GatedDeltaNet"), ("kda", "KimiDeltaAttention"),
                                           ("mamba2", "Mamba2Mixer")])
def test_tiny_checkpoints_load_and_use_the_family(family, kinds, tmp_path):
    from common.engine.hybrid_engine import HybridEngine

    eng = HybridEngine.from_pretrained(gpu_check._tiny(tmp_path, family))
    mixers = [type(layer.mixer).__name__ for layer in eng.model.layers if layer.kind == "linear"]
    assert mixers and all(m == kinds for m in mixers)
    out = eng.prefill(list(range(3, 40)), return_all_logits=True)
    assert torch.isfinite(out.all_logits).all()


def test_wheel_list_is_pinned_and_names_what_the_gpu_path_imports():
    pins = gpu_check.pinned_wheels()
    names = {p.split("==")[0] for p in pins}
    assert {"flash-linear-attention", "fla-core", "lmdb", "structlog", "fastapi", "uvicorn"} <= names
    # protos/ was generated for these: its modules refuse an older grpcio or another protobuf major
    assert {"grpcio", "grpcio-health-checking", "protobuf", "opentelemetry-api"} <= names
    assert not names & {"torch", "triton", "transformers", "numpy"}  # the machine's own


def test_unpinned_wheel_line_is_refused(tmp_path):
    reqs = tmp_path / "r.txt"
    reqs.write_text("# comment\nlmdb==3.0.0\nstructlog\n")
    with pytest.raises(ValueError, match="structlog"):
        gpu_check.pinned_wheels(reqs)


def _wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """A minimal pure-python wheel (a zip of the import tree and its dist-info)."""
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.processes
def test_wheels_install_offline_into_a_target_and_import_from_it(tmp_path):
    """The bare-machine install: --no-index from the folder into --target, then importable there."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "hypic_probe_pkg", "1.2.3", "ANSWER = 42\n")
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("hypic_probe_pkg==1.2.3\n")
    assert gpu_check.install_wheels(wheels, site, reqs) == site
    out = subprocess.run([sys.executable, "-c", "import hypic_probe_pkg as m; print(m.ANSWER, m.__file__)"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[0] == "42" and str(site) in out.stdout
    unpacked = tmp_path / "unpacked"  # the path without pip
    gpu_check.unpack_wheels(wheels, unpacked, ["hypic_probe_pkg==1.2.3"])
    assert (unpacked / "hypic_probe_pkg" / "__init__.py").read_text() == "ANSWER = 42\n"
    with pytest.raises(FileNotFoundError, match="make gpu-wheels"):
        gpu_check.install_wheels(tmp_path / "none", site, reqs)


def test_mid_size_rows_run_on_cpu_at_a_tiny_size(tmp_path):
    """The mid-size rows' own code, at a tiny size in fp32 on CPU: what a GPU session runs in one try."""
    rows = gpu_mid.mid_rows(tmp_path, "cpu", "float32", spec=TINY_SPEC, ttft_sizes=((3, 48), (2, 64)),
                            overhead_tokens=64, floor_size=(3, 48))
    names = [name for name, _, _ in rows]
    assert names == ["mid-size TTFT 3x48: full/prefix/hypic", "mid-size TTFT 2x64: full/prefix/hypic",
                     "mid-size T build overhead", "mid-size warm TTFT vs all-hit floor"]
    assert all(needs == ("cuda",) for _, needs, _ in rows)
    results = [fn() for _, _, fn in rows]
    assert [r[0] for r in results] == ["ok"] * 4, results
    assert "full" in results[0][1] and "prefix reused 0 segments" in results[0][2]
    assert results[2][1].startswith("+") and "64-token segment" in results[2][2]
    assert "x floor" in results[3][1] and "MiB of entries" in results[3][2]


def test_the_plan_names_the_mid_size_rows_at_their_gpu_sizes(tmp_path):
    names = [name for name, _, _ in gpu_check.plan(tmp_path)]
    assert len(names) == N_ROWS
    assert {"mid-size TTFT 8x512: full/prefix/hypic", "mid-size TTFT 32x1024: full/prefix/hypic",
            "mid-size T build overhead", "mid-size warm TTFT vs all-hit floor"} <= set(names)
    spec = __import__("bench.random_model", fromlist=["parse_spec"]).parse_spec(gpu_mid.MID_SPEC)
    assert spec["hidden"] == 2048 and spec["ratio"] == "3:1"  # Qwen3-Next's width and pattern


@pytest.mark.processes
def test_device_tier_ipc_row_runs_its_two_processes_on_cpu(tmp_path):
    """The IPC row's holder (a SegmentStore in a spawned process) and reader, on CPU: the policy
    must pick the host path (no CUDA on either end) and the bytes must arrive intact."""
    status, value, detail = gpu_tier.row_ipc(tmp_path, "cpu", nbytes=1 << 20)
    assert status == "ok", detail
    assert value.startswith("host ") and "path host (expected host)" in detail and "tried: none" in detail


def test_the_combine_ipc_row_skips_without_cuda(tmp_path):
    status, _, detail = gpu_tier.row_combine_ipc(tmp_path, "cpu")
    assert status == "skip" and "no CUDA" in detail


@pytest.mark.processes
def test_the_combine_ipc_row_walks_its_code_on_cpu_by_the_host_path(tmp_path):
    """The row's segcache process, Put, combine fetch and host read on CPU, where the combine sends
    no place and segcache has no tier 0: the path must be "host" and both reads agree."""
    status, value, detail = gpu_tier.row_combine_ipc(tmp_path, "cpu", n_tokens=64, walk_on_cpu=True)
    assert status == "ok", detail
    assert value.startswith("host ") and "path host (expected host)" in detail


@pytest.mark.processes  # the Triton interpreter is read at import: a child process
def test_the_compose_row_walks_its_code_on_cpu_under_the_interpreter():
    """The Triton compose row (batched, run, factored run) at a tiny size on CPU: its kernels under
    TRITON_INTERPRET=1 against the torch references, as the GPU session runs them."""
    pytest.importorskip("triton")
    script = ("import sys; sys.path[:0] = [{root!r}, {scripts!r}]\n"
              "import gpu_check; gpu_check.DEV = 'cpu'\n"
              "print('ROW', gpu_check.row_compose(n=4, G=(2,), K=32, V=20))\n").format(
        root=str(ROOT), scripts=str(ROOT / "scripts"))
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = r.stdout.split("ROW", 1)[1]
    assert "'ok'" in row and "factored run" in row and "2 slices, K=32 V=20" in row, row


def test_the_engine_and_reuse_rows_walk_their_code_on_cpu(tmp_path, monkeypatch):
    """The engine rows (one per kernel family's model) and the entry build + reuse row, pointed at
    the CPU: their own code runs through (on CPU the bf16 run is its own baseline, so each is ok)."""
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    rows = [lambda f=f: gpu_check.row_engine(tmp_path, f) for f in ("gated_deltanet", "kda", "mamba2")]
    for fn in rows + [lambda: gpu_check.row_reuse(tmp_path)]:
        status, value, detail = fn()
        assert status == "ok", (value, detail)
        assert "path torch" in detail or "warm reuse" in detail


@pytest.mark.processes  # a mesh of processes
def test_the_mesh_row_walks_its_code_on_cpu(tmp_path, monkeypatch):
    """The mesh row on CPU: the demo's session through a real mesh (segcache's device tier asked for
    and off without CUDA), both answers the expected ones."""
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    status, value, detail = gpu_check.row_mesh(tmp_path)
    assert status == "ok", (value, detail)
    assert value.startswith("TTFT cold") and "expected" in detail


@pytest.mark.processes  # the reader and a spawned holder
def test_the_nixl_row_walks_its_code_on_cpu(monkeypatch):
    """The NIXL row on CPU: a real READ between two processes, host memory at both ends, so the row
    says DRAM (it is ok only for VRAM) and the bytes read equal those written."""
    from common.mesh.nixl_util import load_nixl

    api, why = load_nixl()
    if api is None:
        pytest.skip(f"nixl: {why}")
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    status, value, detail = gpu_check.row_nixl(nbytes=1 << 20)
    assert (status, detail.split(",")[1:]) == ("FAIL", [" remote mem DRAM", " bytes equal"]), (status, detail)
    assert value.endswith("GB/s") and detail.startswith("1 MiB READ")


# What a GPU session imports: the rows, the mesh they start (every service's entry point, the front
# and the engine with transformers, which the services import lazily), the demo's session.
GPU_PATH_MODULES = ("gpu_check", "gpu_mid", "gpu_tier", "hypic.launcher", "bench.demo", "bench.random_model",
                    "common.engine.hybrid_engine", "transformers", "services.front.app",
                    *(f"services.{s}.__main__" for s in ("router", "segcache", "scatter", "combine", "front")))
# imported only to see whether they are there: grpc probes grpc_tools, structlog's console rich
# (with pygments); setuptools' import hook comes with any venv
OPTIONAL = {"grpcio-tools", "rich", "pygments", "setuptools"}
_CLOSURE = """
import importlib, importlib.metadata as md, json, sys
from pathlib import Path
sys.path[:0] = [{root!r}, {scripts!r}]
for m in {mods!r}:
    importlib.import_module(m)
owner = {{str(Path(d.locate_file(f)).resolve()): d.metadata["Name"]
         for d in md.distributions() for f in (d.files or ()) if f.suffix in (".py", ".so")}}
used = {{owner.get(str(Path(m.__file__).resolve())) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}}
print(json.dumps(sorted(u for u in used if u)))
"""


def _dist(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


@pytest.mark.processes  # a fresh interpreter, so that only these imports count
def test_every_distribution_the_gpu_path_imports_is_on_the_machine_or_among_the_wheels():
    """A bare GPU machine has only its image's packages (requirements/gpu-machine.txt) and the wheels
    `make gpu-wheels` carries: a distribution the rows or the mesh import from neither would end the
    one GPU try on an ImportError."""
    script = _CLOSURE.format(root=str(ROOT), scripts=str(ROOT / "scripts"), mods=GPU_PATH_MODULES)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    used = {_dist(n) for n in json.loads(r.stdout.strip().splitlines()[-1])}
    assert {"torch", "grpcio", "protobuf", "lmdb", "transformers"} <= used  # the walk saw the path
    machine = [line.strip() for line in (ROOT / "requirements" / "gpu-machine.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    wheels = {_dist(p.split("==")[0]) for p in gpu_check.pinned_wheels()}  # installed --no-deps
    assert used - _with_requirements({_dist(n) for n in machine}) - wheels - {"hypic"} - OPTIONAL == set()


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and everything they require, as installed here: what a machine's own package imports
    (huggingface_hub's HTTP client, say) comes with that package there."""
    import importlib.metadata as md
    import re

    out, todo = set(names), list(names)
    while todo:
        try:
            reqs = md.distribution(todo.pop()).requires or []
        except md.PackageNotFoundError:
            continue
        for req in reqs:
            if "extra ==" in req:
                continue
            name = _dist(re.split(r"[ ;<>=!~\[(]", req.strip(), maxsplit=1)[0])
            if name not in out:
                out.add(name)
                todo.append(name)
    return out
