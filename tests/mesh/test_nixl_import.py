"""common.mesh.nixl_util loads the nixl backend that `import nixl` chooses, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.mesh.nixl_util import NIXL_BACKENDS_WITHOUT_CUDA, _torch_build_cuda

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


OURS = """
import json, sys
from common.mesh.nixl_util import load_nixl
api, err = load_nixl()
print(json.dumps({"module": api and api.__name__, "err": err, "torch": "torch" in sys.modules}))
"""
NIXLS_OWN = """
import json, sys
try:
    from nixl import _api
    print(json.dumps({"module": _api.__name__, "err": None}))
except Exception as e:
    print(json.dumps({"module": None, "err": repr(e)}))
"""


@pytest.mark.processes
def test_the_same_backend_as_nixls_own_choice_and_no_torch():
    ours, theirs = _run(OURS), _run(NIXLS_OWN)
    if theirs["module"] is None:
        pytest.skip(f"nixl does not import here: {theirs['err']}")
    assert ours["err"] is None and ours["module"] == theirs["module"]
    installed, cuda = _torch_build_cuda()
    if installed and cuda is None:  # the case nixl's own import pulls in torch for
        assert ours["module"].split(".")[0] in NIXL_BACKENDS_WITHOUT_CUDA
        assert not ours["torch"], "loading nixl imported torch"


def test_torch_build_read_without_importing_torch():
    import importlib.util

    installed, cuda = _torch_build_cuda()
    assert installed == (importlib.util.find_spec("torch") is not None)
    if installed:
        from torch.version import cuda as torch_cuda

        assert cuda == torch_cuda
