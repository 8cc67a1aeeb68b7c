"""gpu-check's mid-size rows (scripts/gpu_check.py): TTFT on a random model of a real shape.

One random-weight checkpoint of the Qwen3.5 / Qwen3-Next pattern (Gated DeltaNet linear layers,
gated full attention last in each group of four), built by bench/random_model.py, the builder
bench/reuse and bench/anatomy use, loaded once in the model's dtype on the check's device; then:

  TTFT n x L      full recompute / prefix cache / hypic (warm: entries in memory), for
                  8 x 512 and 32 x 1024 tokens, plus a 16-token query; the prefix cache has
                  seen the same segments in another order first (as bench/reuse);
  T overhead      build_entry (the prefill with the fused summary kernel: what scatter runs)
                  over a plain forward of one 1024-token segment, minus 1;
  warm vs floor   the combine's warm request in-process (entries parsed from bytes, placed on
                  the device, composed, seams and query prefilled) against its all-hit floor:
                  the entry bytes at host->device copy speed plus the seam and query tokens at
                  the model's per-token prefill speed (the floor of bench/anatomy, on a GPU).

Every function takes the device, the dtype, the model spec and the sizes, so that
tests/deploy/test_gpu_check.py runs the same code on CPU at a tiny size; on a GPU the
defaults below hold. Nothing here runs without being asked: gpu_check's plan builds the rows.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Callable

# hidden 2048 as Qwen3-Next; 16 layers (not 48) and a 16k vocabulary keep the build and the
# rows within gpu-check's 8 minutes. Random weights: the times mean something, the answers do not.
MID_SPEC = "hidden=2048,layers=16,ratio=3:1,vocab=16384"
TTFT_SIZES = ((8, 512), (32, 1024))
QUERY_TOKENS = 16
SEAM = 8
OVERHEAD_TOKENS = 1024
FLOOR_SIZE = (8, 512)


class MidModel:
    """The mid-size checkpoint, built and loaded on first use and shared by every mid-size row
    (a row that fails to build it FAILs; the next row tries again)."""

    def __init__(self, tmp: Path, device: str, dtype_name: str = "bfloat16", spec: str = MID_SPEC):
        self.tmp, self.device, self.dtype_name, self.spec = Path(tmp), device, dtype_name, spec
        self._engine = None
        self.build_s = 0.0

    @property
    def engine(self):
        if self._engine is None:
            import torch

            from bench.random_model import save_random_model
            from common.engine.hybrid_engine import HybridEngine

            t0 = time.perf_counter()
            path = save_random_model(self.spec, self.tmp / "mid-model")
            self._engine = HybridEngine.from_pretrained(path, dtype=getattr(torch, self.dtype_name),
                                                        device=self.device)
            self.build_s = time.perf_counter() - t0
        return self._engine

    def prompt(self, n: int, seg_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(seed)
        vocab = self.engine.vocab_size
        docs = [[rng.randrange(3, vocab) for _ in range(seg_len)] for _ in range(n)]
        return docs, [rng.randrange(3, vocab) for _ in range(QUERY_TOKENS)]


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable, device: str, repeats: int = 2, warmup: bool = True):
    """(best seconds, last result), the device synchronised around each call."""
    out = fn() if warmup else None
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _finite(out) -> bool:
    import torch

    return bool(torch.isfinite(out.logits.float()).all())


def row_ttft(mid: MidModel, n: int, seg_len: int):
    """TTFT full / prefix / hypic for n segments of seg_len tokens (+ the query)."""
    eng, dev = mid.engine, mid.device
    docs, query = mid.prompt(n, seg_len)
    entries = eng.prefill_segments(docs, query, mode="hypic", seam=SEAM).extra["entries"]
    eng.prefix_cache.clear()
    seen = docs[1:] + docs[:1]  # an earlier request with the same documents in another order
    eng.prefill_segments(seen, query, mode="prefix", seam=SEAM)
    # prefix once, cold for this order: a second call would find this very order cached
    t_pre, pre = timed(lambda: eng.prefill_segments(docs, query, mode="prefix", seam=SEAM), dev, 1, warmup=False)
    t_full, full = timed(lambda: eng.prefill_segments(docs, query, mode="full", seam=SEAM), dev)
    t_hyp, hyp = timed(lambda: eng.prefill_segments(docs, query, entries=entries, mode="hypic", seam=SEAM), dev)
    eng.prefix_cache.clear()
    ok = all(map(_finite, (full, pre, hyp))) and pre.extra.get("reused_segments") == 0
    return ("ok" if ok else "FAIL", f"full {t_full * 1e3:.0f} / prefix {t_pre * 1e3:.0f} / hypic {t_hyp * 1e3:.0f} ms",
            f"{n} x {seg_len} + {QUERY_TOKENS} tokens, {mid.dtype_name}, {mid.spec}; hypic x{t_full / t_hyp:.1f} "
            f"vs full; prefix reused {pre.extra.get('reused_segments')} segments (another order seen first)")


def row_build_overhead(mid: MidModel, tokens: int = OVERHEAD_TOKENS):
    """T build overhead: build_entry over a plain forward of one segment, minus 1."""
    eng, dev = mid.engine, mid.device
    seg = mid.prompt(1, tokens, seed=1)[0][0]
    t_fwd, _ = timed(lambda: eng.forward(seg), dev, 3)
    t_build, entry = timed(lambda: eng.build_entry(seg, SEAM), dev, 3)
    overhead = t_build / t_fwd - 1
    ok = math.isfinite(overhead) and entry.n_tokens == tokens
    return ("ok" if ok else "FAIL", f"+{overhead:.0%}",
            f"{tokens}-token segment: forward {t_fwd * 1e3:.1f} ms, build_entry (T, S, seam keys) "
            f"{t_build * 1e3:.1f} ms; model built+loaded in {mid.build_s:.0f} s")


def all_hit_floor(mid: MidModel, blobs: list[bytes], seg: list[int], n_tokens: int) -> dict:
    """The warm request's floor: every entry byte copied host->device once (pinned memory on
    CUDA, as a staged read lands) plus n_tokens at the per-token speed of a one-segment forward."""
    import torch

    eng, dev = mid.engine, mid.device
    nbytes = sum(map(len, blobs))
    src = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    if str(dev).startswith("cuda"):
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_copy, _ = timed(lambda: dst.copy_(src, non_blocking=True), dev, 3)
    t_fwd, _ = timed(lambda: eng.forward(seg), dev, 3)
    per_token = t_fwd / len(seg)
    return dict(bytes=nbytes, copy_s=t_copy, gbps=nbytes / t_copy / 1e9, per_token_s=per_token,
                tokens=n_tokens, floor_s=t_copy + n_tokens * per_token)


def row_warm_floor(mid: MidModel, n: int = FLOOR_SIZE[0], seg_len: int = FLOOR_SIZE[1]):
    """Warm TTFT in-process (entries from bytes, placed, composed) against the all-hit floor."""
    from common.engine.pic.entry import SegmentEntry
    from common.engine.pic.placement import place_for_engine

    eng, dev = mid.engine, mid.device
    docs, query = mid.prompt(n, seg_len, seed=2)
    blobs = [eng.build_entry(d, SEAM).to_bytes() for d in docs]

    def warm():
        entries = [place_for_engine(SegmentEntry.from_bytes(b), eng) for b in blobs]
        return eng.prefill_segments(docs, query, entries=entries, mode="hypic", seam=SEAM)

    t_warm, out = timed(warm, dev, 3)
    floor = all_hit_floor(mid, blobs, docs[0], n * SEAM + len(query))
    ratio = t_warm / floor["floor_s"]
    ok = _finite(out) and ratio >= 1.0  # below the floor: the floor or the timing is wrong
    return ("ok" if ok else "FAIL", f"warm {t_warm * 1e3:.1f} ms = {ratio:.1f}x floor {floor['floor_s'] * 1e3:.1f} ms",
            f"{n} x {seg_len}: {floor['bytes'] / 2**20:.1f} MiB of entries at {floor['gbps']:.1f} GB/s "
            f"({floor['copy_s'] * 1e3:.2f} ms) + {floor['tokens']} seam/query tokens x "
            f"{floor['per_token_s'] * 1e6:.1f} us")


def mid_rows(tmp: Path, device: str, dtype_name: str = "bfloat16", spec: str = MID_SPEC,
             ttft_sizes=TTFT_SIZES, overhead_tokens: int = OVERHEAD_TOKENS, floor_size=FLOOR_SIZE):
    """gpu_check plan entries: (check name, pieces it needs, function), sharing one MidModel."""
    mid = MidModel(tmp, device, dtype_name, spec)
    rows = [(f"mid-size TTFT {n}x{L}: full/prefix/hypic", ("cuda",), lambda n=n, L=L: row_ttft(mid, n, L))
            for n, L in ttft_sizes]
    rows += [("mid-size T build overhead", ("cuda",), lambda: row_build_overhead(mid, overhead_tokens)),
             ("mid-size warm TTFT vs all-hit floor", ("cuda",), lambda: row_warm_floor(mid, *floor_size))]
    return rows
