"""The shadow monitor and the drift guard on a real mesh of the bundled model (issue 26, item 4).

A fault the operator would never see in an answer (combine --fault compose-without-t: cached
entries composed without T) is flagged by the monitor within its first window of shadowed requests,
and the guard widens the seam, then serves hypic requests by full recompute: the answers are full
recompute's again. Without a fault, the monitor reports for hypic w=8 the figures the offline
evaluation (bench.quality.eval --drift-offline) reports for the same prompts.
"""

from __future__ import annotations

import json
import time

import pytest

import hypic
from bench.quality.eval import prompt_ids
from common.engine.hybrid_engine import HybridEngine
from hypic.launcher import DEFAULT_MODEL, REPO_ROOT, Mesh

pytestmark = [pytest.mark.processes, pytest.mark.timeout(900)]

WINDOW = 4        # the guard decides on this many shadows per level
MAX_TOKENS = 16
OFFLINE = REPO_ROOT / "bench" / "quality" / "results" / "drift_offline.json"


@pytest.fixture(scope="module")
def engine() -> HybridEngine:
    return HybridEngine.from_pretrained(DEFAULT_MODEL)


def settled(client: hypic.Client, sampled: int, timeout_s: float = 60.0):
    """Info once every one of the `sampled` requests has been shadowed or dropped."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.info()
        d = info.drift
        if d.sampled >= sampled and d.shadowed + d.dropped >= d.sampled:
            return info
        assert time.monotonic() < deadline, f"shadows not settled: {d}"
        time.sleep(0.05)


def test_a_hidden_fault_is_flagged_and_the_guard_brings_full_recompute_answers_back(tmp_path, engine) -> None:
    args = {"combine": ["--fault", "compose-without-t"],
            "router": ["--shadow-rate", "1", "--drift-window", str(WINDOW), "--drift-guard-hold-s", "3600"]}
    with Mesh(None, tmp_path, n_scatter=0, threads=1, extra_args=args, start_timeout_s=240) as mesh, \
            hypic.Client(mesh.router_address, timeout=120) as client:
        flagged_at, levels = None, []
        for i in range(4 * WINDOW):  # three levels (8, 16, 32) of WINDOW shadows each, and spare
            segments, query, _ = prompt_ids(engine, "update", i)
            result = client.generate(segments, query, max_tokens=MAX_TOKENS, stream=False)
            levels.append((result.served.mode, result.served.seam, result.served.shadowed))
            drift = settled(client, sampled=sum(shadowed for *_, shadowed in levels)).drift
            if flagged_at is None and drift.over_threshold > 0:
                flagged_at = i
            if drift.guard_full:
                break
        assert drift.dropped == 0, drift
        # The first request composed without T already crosses the threshold; the guard then steps
        # 8 -> 16 -> 32 -> full recompute, one window of shadows at each width.
        assert flagged_at is not None and flagged_at < WINDOW, (flagged_at, drift)
        assert drift.guard_full, (levels, drift)
        assert [seam for _, seam, _ in levels] == [8] * WINDOW + [16] * WINDOW + [32] * WINDOW, levels
        assert drift.agreement_mean < 0.9 or drift.kl_mean > 0.1, drift

        # Served by full recompute now: the answers are full recompute's, and are not shadowed.
        for i in range(100, 103):
            segments, query, _ = prompt_ids(engine, "update", i)
            guarded = client.generate(segments, query, max_tokens=MAX_TOKENS, stream=False)
            full = client.generate(segments, query, max_tokens=MAX_TOKENS, stream=False, mode="full")
            assert guarded.served.mode == "full" and not guarded.served.shadowed, guarded.served
            assert guarded.tokens == full.tokens
        assert client.info().drift.sampled == len(levels)


def test_the_monitor_reports_the_offline_figures_for_the_same_prompts(tmp_path, engine) -> None:
    offline = json.loads(OFFLINE.read_text())
    assert offline["fingerprint"] == engine.fingerprint, "drift_offline.json is another model's: regenerate it"
    prompts = offline["prompts"]
    args = {"router": ["--shadow-rate", "1", "--no-drift-guard", "--seam", str(offline["seam"]),
                       "--shadow-steps", str(offline["steps"]), "--drift-window", str(len(prompts))]}
    with Mesh(None, tmp_path, n_scatter=0, threads=1, extra_args=args, start_timeout_s=240) as mesh, \
            hypic.Client(mesh.router_address, timeout=120) as client:
        same_tokens = 0
        for n, p in enumerate(prompts, 1):
            result = client.generate(p["segments"], p["query"], max_tokens=offline["steps"], stream=False,
                                     stop_at_eos=False)
            same_tokens += result.tokens == p["generated"]
            drift = settled(client, sampled=n).drift
    assert drift.shadowed == len(prompts) and drift.dropped == 0, drift
    s = offline["summary"]
    # The same prompts through the mesh: the same answers (a near-tie may flip under another order
    # of float sums) and the same figures, within the offline figures' own 95% intervals.
    assert same_tokens >= 0.9 * len(prompts), same_tokens
    assert s["kl_interval95"][0] <= drift.kl_mean <= s["kl_interval95"][1], (drift, s)
    assert s["agreement_interval95"][0] <= drift.agreement_mean <= s["agreement_interval95"][1], (drift, s)
    assert s["top1_interval95"][0] <= drift.top1_rate <= s["top1_interval95"][1], (drift, s)
    assert abs(drift.kl_mean - s["kl_mean"]) <= 0.25 * (s["kl_interval95"][1] - s["kl_interval95"][0]), (drift, s)
