"""Our fla call path through fla's real Triton kernels, on CPU, under the Triton interpreter.

fla must never be installed in the main virtualenv, so this runs tests/support/fla_interpreter_child.py
in the separate one that `make fla-venv` builds (.venv-fla, or $HYPIC_FLA_VENV), and compares
what it prints: fla's chunk kernel (prefill), its fused recurrent kernel (decode step) and the
augmented-column summary (T, S) against our torch chunk path, every family, fp32 and fp16,
grouped value heads for the families whose fla kernels take them. Skips, saying why, when that
virtualenv is not there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
FLA_VENV = Path(os.environ.get("HYPIC_FLA_VENV", ROOT / ".venv-fla"))
FLA_PY = FLA_VENV / "bin" / "python"
CHILD = ROOT / "tests" / "support" / "fla_interpreter_child.py"

# relative max error against our fp32 torch path on the same rounded operands
TOL = {"float32": 1e-5, "float16": 5e-3}
# fp16 T of the delta families: fla rounds its chunk states to the input dtype for the matmuls,
# and T decays to 1e-4..1e-6 over 80 tokens here, fp16's subnormal range, so its *relative* error
# is large (measured 1e-2..0.5) while its absolute error, the error per unit of incoming state
# when T composes, stays at fp16 rounding (bf16 has fp32's exponent range; it does not run
# under the interpreter at all). fp16 T is held to the absolute bound, fp32 T to both.
TOL_T_ABS = {"float32": 1e-6, "float16": 2e-3}
EXPECTED = {f"{f}/{d}/H2xHV2" for f in ("retnet", "mamba2", "gla", "gated_deltanet", "kda") for d in ("float32", "float16")}
EXPECTED |= {"deltanet/float16/H2xHV2", "gated_deltanet/float32/H1xHV2", "kda/float32/H1xHV2"}


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return env


def _fla_venv_or_skip() -> None:
    if not FLA_PY.exists():
        pytest.skip(f"no fla virtualenv at {FLA_VENV} (`make fla-venv` builds it; `make test` tries to)")
    probe = subprocess.run([str(FLA_PY), "-c", "import fla.ops, triton, torch"], env=_child_env(),
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"fla does not import in {FLA_VENV}: {probe.stderr.strip().splitlines()[-1:]}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fla_path_through_fla_triton_code(fresh_seed):
    _fla_venv_or_skip()
    proc = subprocess.run([str(FLA_PY), str(CHILD), str(fresh_seed)], env=_child_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    print(json.dumps(report, indent=1), file=sys.stderr)
    assert set(results) == EXPECTED, (sorted(results), report["skipped"])
    for name, errs in results.items():
        dtype = name.split("/")[1]
        for what, err in errs.items():
            if what == "seconds" or (what == "summary_T" and dtype == "float16"):
                continue
            tol = {"summary_T_abs": TOL_T_ABS[dtype], "step_input_state_changed": 0.0}.get(what, TOL[dtype])
            assert err <= tol, f"{name} {what}: {err:.3g} > {tol}"
