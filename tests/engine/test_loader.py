"""common.engine.loader.built_on_meta: modules built with their initialisers skipped (the
checkpoint replaces every parameter), torch.nn.init restored after, and a model worker's start --
load and both warm-ups -- never importing torch._dynamo (2.5 s of CPU it used to pay)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from common.engine.loader import INIT_FUNCTIONS, built_on_meta
from hypic.launcher import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_initialisers_skipped_inside_and_restored_after() -> None:
    originals = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    assert {"normal_", "uniform_", "kaiming_uniform_"} <= set(originals)
    with built_on_meta():
        layer = nn.Linear(4, 3)
        assert nn.init.normal_ is not originals["normal_"]
    assert layer.weight.is_meta and layer.bias.is_meta
    assert {name: getattr(nn.init, name) for name in INIT_FUNCTIONS} == originals
    with pytest.raises(RuntimeError):  # restored on an error too
        with built_on_meta():
            raise RuntimeError("boom")
    assert nn.init.normal_ is originals["normal_"]
    t = torch.zeros(3)
    nn.init.ones_(t)  # the real initialiser again
    assert t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.processes
def test_a_worker_starts_without_torch_dynamo() -> None:
    probe = ("import sys; from services.combine.__main__ import warmup; import services.scatter.__main__; "
             "from common.engine.hybrid_engine import HybridEngine; "
             f"e = HybridEngine.for_worker({str(DEFAULT_MODEL)!r}, 'float32', 'cpu', 1); "
             "e.build_entry([i % e.vocab_size for i in range(16)], 8); warmup(e); "
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
