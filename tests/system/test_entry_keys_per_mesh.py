"""Every local mesh seals its entries with a key, and another mesh's key opens none of them:
hypic.launcher.Mesh gives every service the same entry key file; entries a mesh with
key A left in segcache are, for a mesh with key B over the same LMDB, forgeries: dropped, rebuilt,
never an answer. A service without a key says so in its log, once."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hypic
from common.engine.hybrid_engine import HybridEngine
from common.mesh.segcache_client import SegcacheClient
from hypic.launcher import Mesh
from tests.support.tiny import PIC_CONFIGS, save_tiny
from tests.support.worker_mesh import FP32_ENTRIES_ENV

REPO = Path(__file__).resolve().parents[2]
SEAM = 8

pytestmark = [pytest.mark.timeout(600), pytest.mark.processes]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=7, **PIC_CONFIGS["qwen3_5_text"])


def key_file(path: Path) -> Path:
    path.write_text(os.urandom(32).hex())
    return path


def forged_drops(mesh: Mesh) -> int:
    lines = [json.loads(x) for x in mesh.log("combine0").splitlines() if x.startswith("{")]
    return sum(1 for d in lines
               if d.get("event") == "rejected entry dropped from segcache" and d.get("reason") == "forged")


def test_entries_of_a_mesh_with_another_key_are_dropped_and_rebuilt(model, tmp_path, fresh_seed):
    g = random.Random(fresh_seed)
    segs, query = [[g.randrange(1, 500) for _ in range(n)] for n in (40, 70, 25)], [4, 5, 6]
    engine = HybridEngine.from_pretrained(model)
    ref = engine.prefill_segments(segs, query, mode="hypic", seam=SEAM)
    ref_tokens = engine.generate(ref, max_new_tokens=6)
    data = tmp_path / "data"

    def ask(mesh: Mesh):
        with hypic.Client(mesh.router_address, timeout=120) as c:
            res = c.generate(segments=segs, query=query, max_tokens=6, stream=False, return_logits=True)
        assert res.tokens == ref_tokens
        assert (torch.tensor(res.logits) - ref.logits).abs().max() < 1e-4
        return res

    with Mesh(model, data, n_scatter=1, threads=1, seam=SEAM, entry_key_file=key_file(tmp_path / "a.key"),
              env=FP32_ENTRIES_ENV) as a:
        assert ask(a).timings.misses == len(segs)
        assert ask(a).timings.hits == len(segs)  # stored, and they open under key A
        assert forged_drops(a) == 0
    with Mesh(model, data, n_scatter=1, threads=1, seam=SEAM, entry_key_file=key_file(tmp_path / "b.key"),
              env=FP32_ENTRIES_ENV) as b:
        ask(b)  # the router sees A's entries in segcache; combine finds them forged, rebuilds
        assert forged_drops(b) == len(segs)
        again = ask(b)  # B's own rebuilds replaced them
        assert again.timings.hits == len(segs) and forged_drops(b) == len(segs)


def test_a_service_without_an_entry_key_warns_once(tmp_path):
    port_file = tmp_path / "port.json"
    log_path = tmp_path / "segcache.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if "ENTRY_KEY" not in k}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.segcache", "--port", "0", "--port-file",
                                 str(port_file), "--data-dir", str(tmp_path / "lmdb"), "--no-nixl"],
                                cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        target = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"

        async def puts():
            async with SegcacheClient(target) as sc:
                for i in range(3):
                    await sc.put(f"{i:064x}", os.urandom(1000))
        asyncio.run(puts())
    finally:
        proc.kill()
        proc.wait(timeout=10)
    warnings = [x for x in log_path.read_text().splitlines() if "no entry key file" in x]
    assert len(warnings) == 1, warnings
