"""Targeted mutation check: does the suite notice when a property that matters breaks?

    python scripts/mutate.py                 # every mutant (`make mutate`)
    python scripts/mutate.py -k rope -k lpt  # mutants whose name contains one of these
    python scripts/mutate.py --list
    python scripts/mutate.py --baseline      # first check that the selections pass unmutated

Each mutant is one small text patch (file, exact old snippet, new snippet) applied to a scratch
copy of the working tree (tracked and untracked, not ignored, files), then only the tests that
cover it run there. KILLED: the tests failed (what we want); SURVIVED: they passed; ERROR: the
old snippet is not found exactly once (code moved: fix the patch) or the test selection ran no
test. Exit status 0 only when every mutant is killed.

Not part of `make test`: it runs the covering tests once per mutant (minutes). An issue that
adds a property worth protecting adds its mutant here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PER_MUTANT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, or "-k" expressions


MUTANTS: tuple[Mutant, ...] = (
    Mutant("fp8-entry-scale-dropped", "common/engine/pic/compact.py",
           "return x.float() * scale.float()[..., None, None]", "return x.float()",
           ("tests/engine/pic/test_entry_formats.py", "-k", "error_bounds or round_trip")),
    Mutant("compact-entry-builder-keeps-fp32-S", "common/engine/pic/entry.py",
           'S=round_trip(b.S, fmt, "S")', "S=b.S",
           ("tests/engine/pic/test_entry_formats.py", "-k", "round_trip")),
    Mutant("lowrank-builder-keeps-fp32-factors", "common/engine/pic/entry.py",
           'return LowRankT(body.T.gamma, round_trip(body.T.P, fmt, "T"), round_trip(body.T.Q, fmt, "T"))', "return body.T",
           ("tests/engine/pic/test_lowrank_entries.py", "-k", "each_format and qwen3_next")),
    Mutant("fp8-kv-scale-dropped", "common/engine/pic/compact.py",
           "return (x.float() * scale[..., None]).to(dtype)", "return x.float().to(dtype)",
           ("tests/engine/pic/test_kv_formats.py", "-k", "reference or store_kv")),
    Mutant("fp8-entry-builder-keeps-unrounded-kv", "common/engine/pic/entry.py",
           "else AttentionBody(round_trip_kv(b.keys, kv), round_trip_kv(b.values, kv))", "else b",
           ("tests/engine/pic/test_kv_formats.py", "-k", "store_kv")),
    Mutant("fp8t-stores-S-in-fp8", "common/engine/pic/compact.py",
           '"fp8t": dict(T="fp8", S="bf16", kv="model")', '"fp8t": dict(T="fp8", S="fp8", kv="model")',
           ("tests/engine/pic/test_kv_formats.py", "-k", "fp8t")),
    Mutant("lowrank-T-drops-its-factors", "kernels/linear_attn/lowrank.py",
           "return self.gamma[..., None] * S - self.P.transpose(-1, -2) @ (self.Q @ S)",
           "return self.gamma[..., None] * S",
           ("tests/engine/pic/test_lowrank_entries.py", "-k", "give_the_dense and qwen3_next")),
    # -- composition: the transition operator T, conv warm-up, RoPE offsets, seams -----------------
    Mutant("T-dropped-segment-major", "common/engine/pic/apply.py",
           "S_new = compose(body.summary, S_w)", "S_new = body.summary.S + S_w",
           ("tests/engine/pic/test_reuse_prefill.py",)),
    Mutant("T-dropped-layer-major", "common/engine/pic/seam_plan.py",  # the per-segment scan (warm-up, minimax)
           "running = compose(body.summary, running)", "running = body.summary.S + running",
           ("tests/engine/pic/test_reuse_prefill.py",)),
    Mutant("T-dropped-run-kernel", "common/engine/pic/seam_plan.py",  # the run's one-launch scan
           "Tb = torch.cat([b.T for b in bodies], 0)",
           "Tb = torch.cat([identity_transition(seams.form, 1, b.S.shape[1], b.S.shape[2], b.S.device) "
           "for b in bodies], 0)",
           ("tests/engine/pic/test_compose_runs.py", "-k", "qwen3_5_text or nemotron_h")),
    Mutant("arrived-run-composed-out-of-order", "services/combine/servicer.py",
           "[ready.pop(j).entry for j in run]", "[ready.pop(j).entry for j in reversed(run)]",
           ("tests/services/combine/test_execute.py", "-k", "arrived_runs")),
    Mutant("run-forgets-the-composed-prefix", "common/engine/pic/seam_plan.py",
           "running = before.recurrent if before is not None else torch.zeros_like(bodies[0].S)",
           "running = torch.zeros_like(bodies[0].S)",
           ("tests/engine/pic/test_compose_runs.py", "-k", "qwen3_5_text or kimi_linear")),
    Mutant("run-seam-attends-past-itself", "common/engine/pic/seam_plan.py",  # the plain per-seam path (MLA)
           "end = start + (b - a)", "end = start + (b - a) + 1",
           ("tests/engine/pic/test_compose_runs.py", "-k", "kimi_linear or bailing_hybrid")),
    Mutant("run-seam-sees-its-own-future", "common/engine/pic/seam_plan.py",  # the merged key-block path
           "add(slice(a, b), start, start + b - a, causal=True)",
           "add(slice(a, b), start, start + b - a, causal=False)",
           ("tests/engine/pic/test_compose_runs.py", "-k", "qwen3_5_text or nemotron_h")),
    Mutant("offset-attention-diagonal-not-causal", "common/engine/layers/attention.py",  # fair prefix, chunks
           "o_d, lse_d = flash_block(q, keys[:, :, past:], values[:, :, past:], scale, causal=True)",
           "o_d, lse_d = flash_block(q, keys[:, :, past:], values[:, :, past:], scale, causal=False)",
           ("tests/engine/layers/test_attention.py",)),
    Mutant("arena-extends-a-state-it-already-extended", "common/engine/pic/seam_plan.py",
           "self.length == before.keys.shape[2]", "self.length >= before.keys.shape[2]",
           ("tests/engine/pic/test_compose_runs.py", "-k", "kept_state")),
    Mutant("folded-query-one-position-early", "common/engine/pic/seam_plan.py",
           "seam_pos.extend(range(pos, self.end))", "seam_pos.extend(range(pos - 1, self.end - 1))",
           ("tests/engine/pic/test_compose_and_query.py", "-k", "qwen3_5_text")),
    Mutant("folded-query-forgets-the-composed-state", "common/engine/pic/seam_plan.py",
           "y_q, after = mixer(x[:, ws:], after, ctx)", "y_q, after = mixer(x[:, ws:], None, ctx)",
           ("tests/engine/pic/test_compose_and_query.py", "-k", "qwen3_5_text or nemotron_h")),
    Mutant("run-takes-a-short-body-tail-for-the-conv-state", "common/engine/pic/seam_plan.py",
           "or b.conv_tail.shape[-1] < c - 1", "or b.conv_tail.shape[-1] < 0",
           ("tests/engine/pic/test_compose_and_query.py", "-k", "shorter_than_the_conv")),
    Mutant("conv-warmup-zeroed", "common/engine/pic/apply.py",
           "S_w = run_warmup(mixer, body, S_run, conv_before)",
           "S_w = run_warmup(mixer, body, S_run, None if conv_before is None else torch.zeros_like(conv_before))",
           ("tests/engine/pic/test_reuse_prefill.py",)),
    Mutant("rope-rerotate-off-by-one", "common/engine/layers/rotary.py",
           "torch.tensor([delta], device=keys.device)", "torch.tensor([delta + 1], device=keys.device)",
           ("tests/engine/test_rerotation_and_decode.py",)),
    Mutant("rope-start-off-by-one", "common/engine/pic/apply.py",
           "keys = mixer.rerotate(body.keys, start)", "keys = mixer.rerotate(body.keys, start + 1)",
           ("tests/engine/test_rerotation_and_decode.py", "tests/engine/pic/test_reuse_prefill.py")),
    Mutant("seam-one-token-short", "common/engine/pic/entry.py",
           "return self.token_ids[: self.seam_len]", "return self.token_ids[: max(self.seam_len - 1, 0)]",
           ("tests/engine/pic/test_reuse_prefill.py",)),
    # -- identity and integrity of entries ------------------------------------------------------------
    Mutant("segment-key-ignores-seam", "common/engine/fingerprint.py",
           'struct.pack("<iI", int(seam), len(token_ids))', 'struct.pack("<iI", 0, len(token_ids))',
           ("tests/engine/test_fingerprint.py",)),
    Mutant("checksum-not-checked-on-read", "services/segcache/lmdb_file.py",
           "if checksum(payload) != digest:", "if False:",
           ("tests/services/segcache/test_store.py", "-k", "corrupt")),
    Mutant("seal-reuses-one-poly1305-key", "common/engine/pic/seal.py",
           "key = hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()",
           "key = hmac.new(secret, _DOMAIN, hashlib.sha256).digest()",
           ("tests/services/combine/test_sealed_entry_parse.py", "-k", "fresh")),
    Mutant("sealed-entry-not-checked", "common/engine/pic/seal.py",
           "        good = hmac.compare_digest(_tag(entry, secret, nonce), tag)",
           "        good = True",
           ("tests/services/combine/test_sealed_entry_parse.py",)),
    Mutant("seal-ignores-the-key-it-is-used-under", "common/engine/pic/seal.py",
           "if identity_key(header_of(entry)) != key:", "if False:",
           ("tests/services/segcache/test_untrusted_input.py",)),
    Mutant("segcache-writes-open-to-any-certificate", "common/mesh/auth.py",
           "if self.writer_names.intersection(names):", "if names:",
           ("tests/system/test_tls_and_auth.py", "-k", "writer_role")),
    Mutant("ring-places-by-address-order", "common/mesh/segcache_ring.py",
           "return max(addresses, key=lambda a: weight(a, key))", "return sorted(addresses)[0]",
           ("tests/mesh/test_segcache_ring.py", "-k", "owner or moves")),
    Mutant("launcher-gives-segcache-no-remote-url", "hypic/launcher.py",
           'remote = ["--remote-url", self.remote_url] if self.remote_url else []', "remote = []",
           ("tests/system/test_shared_remote_tier.py", "-k", "box_b")),
    Mutant("segcache-closes-the-client-of-a-dead-master", "services/segcache/remote_tier.py",
           "        if not self._master_answers():\n            log.warning(\"shared tier's master",
           "        if False:\n            log.warning(\"shared tier's master",
           ("tests/system/test_shared_remote_tier.py", "-k", "box_b")),
    Mutant("remote-object-digest-not-checked", "services/segcache/remote_tier.py",
           "or payload.size == 0 \\\n                or checksum(payload) != digest:",
           "or payload.size == 0:",
           ("tests/services/segcache/test_remote_tier.py", "-k", "every_bad_object")),
    Mutant("segcache-gives-mooncake-its-bind-host", "services/segcache/__main__.py",
           "local_host=cfg.remote_local_host,", "local_host=cfg.host,",
           ("tests/services/segcache/test_remote_tier.py", "-k", "advertised_name")),
    Mutant("wildcard-host-accepted-with-remote-tier", "services/segcache/config.py",
           "if self.remote_url and not self.advertise_host and self.host.strip() in WILDCARDS:",
           "if False:",
           ("tests/services/segcache/test_remote_tier.py", "-k", "wildcard")),
    Mutant("claim-never-held-against-others", "services/segcache/claims.py",
           "if c is not None and c.expires_at > now and c.holder != holder:", "if False:",
           ("tests/services/segcache/test_build_claims.py", "-k", "claim_table")),
    # -- scheduling ------------------------------------------------------------------------------------
    Mutant("lpt-shortest-first", "services/router/planner.py",
           "key=lambda j: (-costs[j], j)", "key=lambda j: (costs[j], j)",
           ("tests/services/router/test_planner.py", "-k", "lpt")),
    Mutant("planner-assigns-shortest-first", "services/router/planner.py",
           "key=lambda j: (-est[j.key], j.index)", "key=lambda j: (est[j.key], j.index)",
           ("tests/services/router/test_planner.py", "-k", "misses_longest_first")),
    Mutant("planner-no-single-flight", "services/router/planner.py",
           "flight = self._inflight.get(job.key)", "flight = None",
           ("tests/services/router/test_planner.py", "-k", "single_flight")),
    Mutant("scatter-no-single-flight", "services/scatter/servicer.py",
           "fl = self.flights.get(key)\n", "fl = None\n",
           ("tests/services/scatter/test_build.py", "-k", "single_flight")),
    Mutant("build-cancel-check-never-fires", "common/engine/pic/build.py",
           "        if should_stop():\n", "        if False:\n",
           ("tests/system/test_abandoned_builds_stop.py", "-k", "should_stop")),
    Mutant("scatter-never-stops-a-running-build", "services/scatter/servicer.py",
           "        fl.stop.set()\n", "        pass\n",
           ("tests/system/test_abandoned_builds_stop.py", "-k", "abandoned_request")),
    Mutant("combine-never-stops-a-local-build", "services/combine/fetch.py",
           "        stop.set()\n", "        pass\n",
           ("tests/system/test_abandoned_builds_stop.py", "-k", "local")),
    Mutant("front-deep-json-unhandled", "services/front/app.py",
           "    except RecursionError:\n", "    except ZeroDivisionError:\n",
           ("tests/system/test_fuzzed_requests.py", "-k", "front")),
    Mutant("combine-asks-the-next-scatter-after-a-wrong-format", "services/combine/fetch.py",
           "            if got is WRONG_FORMAT:\n                break\n", "            if got is WRONG_FORMAT:\n                pass\n",
           ("tests/services/combine/test_entry_format_mismatch.py", "-k", "fp32_combine")),
    Mutant("segcache-format-bytes-kept-on-eviction", "services/segcache/records.py",
           "        acc[0] -= n\n", "        acc[0] -= 0\n",
           ("tests/services/segcache/test_entry_formats.py",)),
    Mutant("combine-dials-any-planned-segcache", "services/combine/segcache_members.py",
           "    if unknown:\n", "    if False:\n",
           ("tests/services/combine/test_segcache_members.py",)),
    Mutant("front-shows-routers-no-certificate", "services/front/routers.py",
           "tls_cert=tls_cert if secure else None,\n            tls_key=tls_key if secure else None,",
           "tls_cert=None, tls_key=None,",
           ("tests/system/test_hypic_up_tls.py", "-k", "answer_alike")),
    Mutant("router-never-releases-ticket", "services/router/servicer.py",
           "self.planner.release(req.ticket)", "pass",
           ("tests/services/router/test_failed_request_releases_load.py",)),
    Mutant("router-cost-model-never-learns", "services/router/servicer.py",
           "build_s = ready.build_s if ready.source == combine_pb.SOURCE_SCATTER else 0.0", "build_s = 0.0",
           ("tests/system/test_deadlines_and_cost_learning.py", "-k", "cost_model")),
    # -- cache policy ----------------------------------------------------------------------------------
    Mutant("gdsf-ignores-cost", "services/segcache/policy.py",
           "max(freq, 1) * max(cost, 0.0) / max(size, 1)", "max(freq, 1) * 1.0 / max(size, 1)",
           ("tests/services/segcache/test_store.py", "-k", "eviction or gdsf")),
    Mutant("lru-evicts-newest", "services/segcache/policy.py",
           "self._od.popitem(last=False)", "self._od.popitem(last=True)",
           ("tests/services/segcache/test_store.py", "-k", "eviction")),
    # -- deadlines -------------------------------------------------------------------------------------
    Mutant("combine-ignores-callers-deadline", "services/combine/servicer.py",
           "Deadline(remaining if remaining is not None else self.cfg.default_timeout_s)",
           "Deadline(self.cfg.default_timeout_s)",
           ("tests/system/test_deadlines_and_cost_learning.py", "-k", "remaining_time")),
    # -- decode state ----------------------------------------------------------------------------------
    Mutant("decode-drops-linear-state", "common/engine/models/decoder.py",
           "return self.output(o, aux, x.dtype), LinearLayerState(tail, S)",
           "return self.output(o, aux, x.dtype), LinearLayerState(tail, S0 if x.shape[1] == 1 and S0 is not None else S)",
           ("tests/engine/test_rerotation_and_decode.py", "-k", "decode_logits")),
    # -- the same-GPU read (CUDA IPC) ------------------------------------------------------------------
    Mutant("device-entry-ignores-its-key", "common/engine/pic/device_entry.py",
           "    if identity_key(header) != key:\n", "    if False:\n",
           ("tests/engine/pic/test_device_entry.py", "-k", "refusals")),
    Mutant("segcache-device-lease-release-keeps-the-pin", "services/segcache/device_reads.py",
           "        self.reads.release(held.served)\n        return True\n", "        return True\n",
           ("tests/services/segcache/test_placed_reads.py", "-k", "same_gpu")),
    # -- streaming -------------------------------------------------------------------------------------
    Mutant("segcache-get-chunk-drops-a-byte", "services/segcache/servicer.py",
           "data = arr[off:off + chunk].tobytes()", "data = arr[off:off + chunk - 1].tobytes()",
           ("tests/services/segcache/test_service.py", "-k", "byte_exact")),
    Mutant("framed-lmdb-value-keeps-a-stale-header", "services/segcache/lmdb_file.py",
           "        HEADER.pack_into(framed, 0, MAGIC, FORMAT_VERSION, 0, arr.nbytes, digest)\n", "",
           ("tests/services/segcache/test_framed_values.py",)),
    Mutant("segcache-stream-window-not-applied", "services/segcache/__main__.py",
           "return stream_window_options(self.cfg.stream_window_bytes)", "return []",
           ("tests/services/segcache/test_stream_window.py", "-k", "announces")),
    # -- running the mesh ------------------------------------------------------------------------------
    Mutant("nixl-loaded-from-another-backend", "common/mesh/nixl_util.py",
           "for name in NIXL_BACKENDS_WITHOUT_CUDA:", "for name in reversed(NIXL_BACKENDS_WITHOUT_CUDA):",
           ("tests/mesh/test_nixl_import.py",)),
    Mutant("chat-template-blocks-keep-their-indent", "services/front/chat_render.py",
           "trim_blocks=True, lstrip_blocks=True,", "trim_blocks=True, lstrip_blocks=False,",
           ("tests/services/front/test_chat_render.py",)),
    Mutant("nixl-progress-thread-spins", "common/mesh/nixl_util.py",
           "PROGRESS_POLL_US = 100_000", "PROGRESS_POLL_US = 0",
           ("tests/system/test_idle_mesh_cpu.py",)),
    Mutant("sigterm-no-drain", "common/mesh/server.py",
           "sig = await wait_for_shutdown_signal(timeout_s=drain_s)", "sig = None",
           ("tests/mesh/test_graceful_shutdown.py", "-k", "drain")),
    # -- observability: one log format, one metric namespace -------------------------------------------
    Mutant("stdlib-logs-plain-text", "common/mesh/log.py",
           "handler.setFormatter(formatter)",
           'handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))',
           ("tests/system/test_metrics_and_log_format.py", "-k", "stdlib or debug")),
    Mutant("library-keeps-its-console-handler", "common/mesh/log.py",
           "            logger.removeHandler(h)", "            pass",
           ("tests/system/test_metrics_and_log_format.py", "-k", "stdlib")),
    Mutant("metric-outside-namespace", "services/scatter/metrics.py",
           'Counter("hypic_scatter_builds"', 'Counter("scatter_builds"',
           ("tests/system/test_metrics_and_log_format.py", "-k", "metric_family")),
    # -- the demo --------------------------------------------------------------------------------------
    Mutant("demo-says-faster-when-slower", "bench/demo.py",
           "if hypic_s < full_s:", "if True:",
           ("tests/bench/test_demo.py", "-k", "verdict")),
    Mutant("demo-compares-cold-requests-too", "bench/demo.py",
           'full = [t for r in rows if r.cache == "warm" for t in r.ttft_s["full"]]',
           'full = [t for r in rows for t in r.ttft_s["full"]]',
           ("tests/bench/test_demo.py", "-k", "report")),
    Mutant("compose-cpu-router-misses-a-scatter", "docker-compose.cpu.yml",
           '"--scatter-addresses", "127.0.0.1:23071,127.0.0.1:23072"',
           '"--scatter-addresses", "127.0.0.1:23071"',
           ("tests/deploy/test_compose_cpu_override.py",)),
    Mutant("compose-combine-without-entry-key", "docker-compose.yml",
           "      HYPIC_COMBINE_ENTRY_KEY_FILE: /run/secrets/entry-key\n", "",
           ("tests/deploy/test_compose_file.py",)),
    # -- issue 31: behaviours users rely on that no test named (only a log line would show them) ------
    Mutant("sampling-multiplies-by-temperature", "common/engine/hybrid_engine.py",
           "logits = logits.float() / temperature", "logits = logits.float() * temperature",
           ("tests/engine/test_sampling_distribution.py",)),
    Mutant("top-k-drops-the-kth-token", "common/engine/hybrid_engine.py",
           'logits.masked_fill(logits < v[-1], float("-inf"))',
           'logits.masked_fill(logits <= v[-1], float("-inf"))',
           ("tests/engine/test_sampling_distribution.py", "-k", "top_k")),
    Mutant("top-k-ignored", "common/engine/hybrid_engine.py",
           "    if top_k > 0:", "    if top_k > 0 and False:",
           ("tests/engine/test_sampling_distribution.py", "-k", "top_k")),
    Mutant("pinned-entry-evictable-from-host", "services/segcache/store.py",
           "            if e.evictable:\n                self.host.policy.add(e.key, e.size, e.cost, e.freq)",
           "            self.host.policy.add(e.key, e.size, e.cost, e.freq)",
           ("tests/services/segcache/test_pins.py",)),
    Mutant("claim-wait-ignores-the-holders-lease", "services/router/claims.py",
           "out.waiting[r.key] = min(wait_cap_s, max(r.expires_in_s, 0.0))",
           "out.waiting[r.key] = wait_cap_s",
           ("tests/services/router/test_claim_leases.py",)),
    Mutant("sdk-retries-invalid-argument", "hypic/targets.py",
           '"retryableStatusCodes": ["UNAVAILABLE"]',
           '"retryableStatusCodes": ["UNAVAILABLE", "INVALID_ARGUMENT"]',
           ("tests/sdk/test_retries.py",)),
    Mutant("cached-tokens-count-built-segments", "services/router/request.py",
           "for i, (src, tier) in self.ready.items() if src == combine_pb.SOURCE_SEGCACHE} \\",
           "for i, (src, tier) in self.ready.items()} \\",
           ("tests/services/front/test_cached_tokens.py",)),
    Mutant("prefix-recomputed-ignores-combines-count", "services/router/request.py",
           "t.recomputed = min(self.combine_timings.recomputed, len(self.segments))",
           "t.recomputed = len(self.segments)",
           ("tests/services/router/test_request_served.py",)),
    Mutant("front-headers-say-nothing-of-reuse", "services/front/transparency.py",
           "figures = {name: getattr(served, name) if served is not None else None for name in FIELDS}",
           "figures = {name: getattr(served, name) if served is not None and name != 'reused' else 0 "
           "for name in FIELDS}",
           ("tests/services/front/test_hypic_transparency.py", "-k", "cold_then_warm")),
    Mutant("cached-tokens-by-tier-counts-segments", "services/router/request.py",
           "t.cached_tokens_by_tier[key] = t.cached_tokens_by_tier.get(key, 0) + body",
           "t.cached_tokens_by_tier[key] = t.cached_tokens_by_tier.get(key, 0) + 1",
           ("tests/services/front/test_cached_tokens.py",)),
    Mutant("ring-lookup-ignores-member-health", "common/mesh/segcache_ring.py",
           "up = self.healthy()\n        groups = group_by_owner(keys, up) if up else {}  # no members: every key a miss",
           "up = list(self.addresses)\n        groups = group_by_owner(keys, up) if up else {}  # no members: every key a miss",
           ("tests/mesh/test_ring_health.py",)),
    Mutant("ring-keeps-its-first-dns-members", "common/mesh/segcache_ring.py",
           "        self.addresses = list(members)\n", "        self.addresses = self.addresses or list(members)\n",
           ("tests/mesh/test_segcache_members.py",)),
    Mutant("restart-ignores-a-shrunk-disk-budget", "services/segcache/store.py",
           "if self.disk.bytes > self.disk.budget:  # the budget shrank",
           "if False:  # the budget shrank",
           ("tests/services/segcache/test_shrunk_disk_budget.py",)),
    Mutant("restart-evictions-left-in-lmdb", "services/segcache/store.py",
           "                self._lmdb.commit(deletes=victims)\n                log.warning(\"disk budget",
           "                pass\n                log.warning(\"disk budget",
           ("tests/services/segcache/test_shrunk_disk_budget.py",)),
    Mutant("router-builds-on-a-worker-of-another-model", "services/router/pools.py",
           "if r.model_fingerprint and self.fingerprint and r.model_fingerprint != self.fingerprint:",
           "if False:",
           ("tests/services/router/test_foreign_scatter.py",)),
    # -- the drift guard ---------------------------------------------------------------------------------
    Mutant("drift-guard-never-steps-up", "services/router/drift_guard.py",
           "                self._step(+1)", "                pass",
           ("tests/services/router/test_drift_guard.py",)),
    Mutant("drift-guard-counts-stale-seams", "services/router/drift_guard.py",
           "if self._level == self.full_level or seam != self.seams[self._level]:",
           "if self._level == self.full_level:",
           ("tests/services/router/test_drift_guard.py", "-k", "another_seam")),
    Mutant("router-plans-hypic-without-the-guard", "services/router/servicer.py",
           "                seam = guard_seam", "                pass",
           ("tests/services/router/test_guard_plans.py", "-k", "follow")),
    # -- benchmarks --------------------------------------------------------------------------------------
    Mutant("best-baseline-is-the-slower", "bench/report_baseline.py",
           "    pick = max if higher_is_better else min", "    pick = min if higher_is_better else max",
           ("tests/bench/test_report_baseline.py",)),
    Mutant("trace-hash-ids-not-chained", "bench/trace.py",
           "            prev = hashlib.blake2b(prev + block, digest_size=16).digest()",
           "            prev = hashlib.blake2b(block, digest_size=16).digest()",
           ("tests/bench/test_trace.py", "-k", "mooncake")),
    Mutant("chat-window-keeps-the-oldest-turns", "bench/workloads.py",
           '        segs = [sess["system"]] + sess["turns"][-turn_window:]',
           '        segs = [sess["system"]] + sess["turns"][:turn_window]',
           ("tests/bench/test_workloads_reuse.py", "-k", "chat")),
    Mutant("hit-rate-over-segments-sent", "bench/driver.py",
           '        out["hit_rate"] = hits / looked_up', '        out["hit_rate"] = hits / segs',
           ("tests/bench/test_driver_summary.py",)),
    Mutant("cut-leaves-a-short-tail", "common/engine/cut.py",
           "        stop = start + size + (1 if k < extra else 0)",
           "        stop = min(len(ids), start + max_tokens) if k < n - 1 else len(ids)",
           ("tests/engine/test_cut.py",)),
    Mutant("report-drops-random-model-ratios", "bench/report.py",
           "        out += closing_rows_random(rnd)", "        pass",
           ("tests/bench/test_report.py",)),
    Mutant("report-cold-from-old-simulation", "bench/report.py",
           "    out += replay_section(replay, cold) if replay else simulated_section(si, me)",
           "    out += simulated_section(si, me)",
           ("tests/bench/test_report.py",)),
    Mutant("report-cold-closing-rows-from-old-simulation", "bench/report.py",
           "    if replay:\n        out += closing_rows_replay(replay)\n    elif",
           "    if False:\n        out += closing_rows_replay(replay)\n    elif",
           ("tests/bench/test_report.py",)),
    Mutant("cold-bound-without-query", "bench/cold_model.py",
           'r[f"ttft_zero_cost_combine{tag}_s"] = ov + r["makespan_s"] + query_s',
           'r[f"ttft_zero_cost_combine{tag}_s"] = ov + r["makespan_s"]',
           ("tests/bench/test_report.py",)),
    # -- tracing: the caller's context must ride on every call, and a server must continue it ------
    Mutant("trace-context-not-sent", "common/mesh/tracing.py",
           "    metadata = inject(list(details.metadata or ()))",
           "    metadata = list(details.metadata or ())",
           ("tests/mesh/test_tracing.py",)),
    Mutant("trace-not-continued-by-server", "common/mesh/tracing.py",
           "        parent = extract(handler_call_details.invocation_metadata)",
           "        parent = None",
           ("tests/mesh/test_tracing.py",)),
    # -- shadow recompute: off the request's path, invisible to the client, on idle capacity only ------
    Mutant("shadow-greedy-pick-reaches-client", "services/router/shadow.py",
           '        tok.ClearField("argmax_id")\n', "",
           ("tests/services/router/test_shadow_monitor.py", "-k", "capture")),
    Mutant("shadow-queue-unbounded", "services/router/shadow.py",
           "asyncio.Queue(maxsize=cfg.shadow_queue)", "asyncio.Queue()",
           ("tests/services/router/test_shadow_monitor.py", "-k", "queue")),
    Mutant("combine-shadows-while-serving", "services/combine/shadow.py",
           "if self.in_flight > 0 or self.shadow_running:", "if self.shadow_running:",
           ("tests/services/combine/test_shadow.py", "-k", "busy")),
)


def scratch_copy(dest: Path) -> None:
    """The working tree as it is (tracked + untracked, not ignored) under dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = REPO / os.fsdecode(f)
        if src.is_file() and not src.is_symlink():
            (dest / os.fsdecode(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(f))


def run_tests(tests: tuple[str, ...], root: Path, python: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True,
                          timeout=PER_MUTANT_TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


def baseline(chosen: list[Mutant], root: Path, python: str) -> bool:
    """Every test selection passes on the unmutated tree (else a kill would prove nothing)."""
    ok = True
    for tests in dict.fromkeys(m.tests for m in chosen):
        rc, out = run_tests(tests, root, python)
        last = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"{'BASE-OK' if rc == 0 else 'BASE-RED':8s} {' '.join(tests)}  {last}", flush=True)
        if rc != 0:
            print("\n".join(line for line in out.splitlines() if line.startswith(("E ", "FAILED")))[:4000])
        ok = ok and rc == 0
    return ok


def run_one(m: Mutant, root: Path, python: str) -> tuple[str, float, str]:
    """(KILLED | SURVIVED | ERROR, seconds, note)."""
    target = root / m.path
    if not target.exists():
        return "ERROR", 0.0, f"{m.path} does not exist"
    original = target.read_text()
    n = original.count(m.old)
    if n != 1:
        return "ERROR", 0.0, f"old snippet found {n} times in {m.path}"
    target.write_text(original.replace(m.old, m.new))
    t0 = time.monotonic()
    try:
        rc, out = run_tests(m.tests, root, python)
    except subprocess.TimeoutExpired:
        return "KILLED", time.monotonic() - t0, f"timed out after {PER_MUTANT_TIMEOUT_S}s"
    finally:
        target.write_text(original)
    took = time.monotonic() - t0
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc == 0:
        return "SURVIVED", took, last
    if rc in (4, 5):  # usage error / no tests collected: the selection is wrong, not the code
        return "ERROR", took, f"pytest exit {rc}: {last}"
    failed = next((line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), last)
    return "KILLED", took, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", action="append", default=[], help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every test selection on the unmutated tree (must pass)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name:36s} {m.path}  tests: {' '.join(m.tests)}")
        return 0
    t0 = time.monotonic()
    results: dict[str, int] = {"KILLED": 0, "SURVIVED": 0, "ERROR": 0}
    with tempfile.TemporaryDirectory(prefix="hypic-mutate-") as tmp:
        root = Path(tmp)
        scratch_copy(root)
        if args.baseline and not baseline(chosen, root, args.python):
            print("baseline red: fix the tests before judging mutants")
            return 1
        for m in chosen:
            status, took, note = run_one(m, root, args.python)
            results[status] += 1
            print(f"{status:8s} {m.name:36s} {took:6.1f}s  {note}", flush=True)
    judged = results["KILLED"] + results["SURVIVED"]
    score = results["KILLED"] / judged if judged else 0.0
    print(f"\nmutation score {results['KILLED']}/{judged} = {score:.0%}; errors {results['ERROR']}; "
          f"{len(chosen)} mutants in {time.monotonic() - t0:.0f}s")
    return 0 if results["SURVIVED"] == 0 and results["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
