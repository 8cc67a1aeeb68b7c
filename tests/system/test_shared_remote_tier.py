"""Two "boxes" sharing one Mooncake Store master: box A (two segcache instances, each
its own LMDB, a scatter, a combine, a router) starts the master; box B (its own segcache, LMDB,
scatter, combine and router) is given A's master URL. A request through A's router builds the
segments; the same segments through B's router are hits read from the shared tier (Timings say
"remote", B builds nothing), and every answer equals the in-process reference; after the master
is killed (-9) both boxes still answer correctly.

Also `hypic up`'s flags for this (--segcaches, --remote-tier, --remote-url): bad combinations
are exit 2 before anything starts."""

from __future__ import annotations

import random
import time
import urllib.request
from pathlib import Path

import pytest

import hypic
from common.engine.hybrid_engine import HybridEngine
from hypic.cli import main as cli_main
from hypic.launcher import Mesh, mooncake_missing
from tests.support.tiny import PIC_CONFIGS, save_tiny

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.processes]
SEAM = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=5,
                     **PIC_CONFIGS["qwen3_5_text"])


def remote_written(mesh: Mesh) -> int:
    """Entries the segcaches of `mesh` wrote behind to the shared tier (their /metrics)."""
    total = 0
    for name in mesh.services:
        if not name.startswith("segcache"):
            continue
        port = mesh[name].info["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("hypic_segcache_remote_ops") and 'outcome="written"' in line:
                total += int(float(line.split()[-1]))
    return total


def test_built_on_box_a_is_a_remote_hit_on_box_b(model, tmp_path, fresh_seed) -> None:
    missing = mooncake_missing()
    if missing:
        pytest.skip(missing)
    g = random.Random(fresh_seed)
    segs = [[g.randrange(1, 500) for _ in range(g.randrange(30, 90))] for _ in range(3)]
    query = [g.randrange(1, 500) for _ in range(4)]
    engine = HybridEngine.from_pretrained(model)
    ref = engine.generate(engine.prefill_segments(segs, query, mode="hypic", seam=SEAM),
                          max_new_tokens=4)
    del engine
    common = dict(n_scatter=1, n_combine=1, threads=1, seam=SEAM, start_timeout_s=300,
                  extra_args={"segcache": ["--metrics-port", "0"]})
    with Mesh(model, tmp_path / "a", n_segcache=2, remote_tier=True, **common) as a:
        assert a.remote_url.startswith("mooncake://127.0.0.1:")
        assert a.segcache_address.count(",") == 1  # every client got both instances
        # One deployment, one entry secret: box B opens what box A sealed.
        with Mesh(model, tmp_path / "b", remote_url=a.remote_url, entry_key_file=a.entry_key_file,
                  **common) as b:
            with hypic.Client(a.router_address, timeout=120) as ca:
                ra = ca.generate(segs, query, max_tokens=4, stream=False)
            assert ra.tokens == ref
            assert ra.timings.misses == 3 and ra.timings.hits == 0
            end = time.monotonic() + 30
            while remote_written(a) < 3:  # the write-behind reached the store
                assert time.monotonic() < end, "box A's entries never reached the shared tier"
                time.sleep(0.2)
            assert remote_written(b) == 0
            with hypic.Client(b.router_address, timeout=120) as cb:
                rb = cb.generate(segs, query, max_tokens=4, stream=False)
                again = cb.generate(segs, query, max_tokens=4, stream=False)
            print(f"\n[two boxes] A: {ra.timings.hits_by_tier} misses {ra.timings.misses}; "
                  f"B: {rb.timings.hits_by_tier} {rb.timings.cached_tokens_by_tier}; "
                  f"B again: {again.timings.hits_by_tier}; "
                  f"TTFT A {ra.timings.ttft_s * 1e3:.0f} ms, B {rb.timings.ttft_s * 1e3:.0f} ms")
            assert rb.tokens == ref and again.tokens == ref
            assert rb.timings.misses == 0 and rb.timings.hits_by_tier == {"remote": 3}
            assert set(rb.timings.cached_tokens_by_tier) == {"remote"}
            assert all(s.source == "segcache" and s.tier == "remote" for s in rb.timings.trace)
            # Promoted into B's own tiers: the next request is a local hit.
            assert again.timings.misses == 0 and "remote" not in again.timings.hits_by_tier

            # The master dies (kill -9): the shared tier is gone, no request fails.
            a.kill("mooncake")
            fresh = [[g.randrange(1, 500) for _ in range(g.randrange(30, 90))] for _ in range(2)]
            engine = HybridEngine.from_pretrained(model)
            ref2 = engine.generate(engine.prefill_segments(fresh + segs[:1], query, mode="hypic",
                                                           seam=SEAM), max_new_tokens=4)
            del engine
            for box in (a, b):
                with hypic.Client(box.router_address, timeout=120) as c:
                    r = c.generate(fresh + segs[:1], query, max_tokens=4, stream=False)
                assert r.tokens == ref2
    assert all(code == 0 for code in a.exit_codes.values()), a.exit_codes
    assert all(code == 0 for code in b.exit_codes.values()), b.exit_codes


@pytest.mark.parametrize("flags", [["--segcaches", "0"],
                                   ["--remote-tier", "--remote-url", "mooncake://127.0.0.1:5"],
                                   ["--remote-tier", "--no-segcache"],
                                   ["--remote-url", "mooncake://nohost"],
                                   ["--remote-url", "redis://127.0.0.1:6379"]])
def test_up_refuses_bad_cache_flags(flags, tmp_path, capsys) -> None:
    assert cli_main(["up", "--data-dir", str(tmp_path), "--no-front", *flags]) == 2
    assert "hypic up:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was started
