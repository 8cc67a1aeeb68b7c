"""Our chunked torch linear attention vs transformers' own torch fallbacks, side by side (CPU).

    python -m bench.linear_attn [--T 2048] [--reps 3] [--json bench/results/linear_attn.json]

Compared, for the same shapes and inputs (fp32, B = 1):
* Gated DeltaNet: ours ``chunk_gated_deltanet`` vs transformers' ``torch_chunk_gated_delta_rule``
  (qwen3_5);
* KDA: ours ``chunk_kda`` vs kimi_linear's ``chunk_kimi_delta_attention`` torch fallback, with a
  mild decay and a strong (real-model-like) per-channel decay;
* Mamba2: ours ``chunk_mamba2`` vs nemotron_h's ``mamba2_chunk_scan`` torch SSD path.
Each row also prints the relative difference of the two outputs (a sanity check). Timings interleave
ours and theirs and keep the best of --reps; by default one thread and the process CPU clock, which
stays meaningful when other jobs share the cores (--clock wall --threads 2 for wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from kernels.linear_attn.chunk import chunk_gated_deltanet, chunk_kda, chunk_mamba2


CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def _time_pair(ours, theirs, reps: int) -> tuple[float, float]:
    """Best of ``reps`` interleaved runs of each."""
    ours(), theirs()
    a, b = [], []
    for _ in range(reps):
        t0 = _clock()
        ours()
        a.append(_clock() - t0)
        t0 = _clock()
        theirs()
        b.append(_clock() - t0)
    return min(a), min(b)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench_gdn(T, H, K, V, reps):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=g)
    k = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(1, T, H, generator=g) + 3.0)
    beta = torch.rand(1, T, H, generator=g)
    ours = lambda: chunk_gated_deltanet(q, k, v, gate, beta)
    theirs = lambda: torch_chunk_gated_delta_rule(q, k, v, gate, beta, output_final_state=True)
    (o1, s1), (o2, s2) = ours(), theirs()
    return (*_time_pair(ours, theirs, reps), max(_rel(o1, o2), _rel(s1, s2)))


def bench_kda(T, H, K, V, reps, strong=False):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    g = torch.Generator().manual_seed(1)
    q = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    if strong:  # kimi-like: -A * softplus(.), A ~ U(1, 16)
        A = torch.empty(H, 1).uniform_(1, 16, generator=g)
        gate = -A * F.softplus(torch.randn(1, T, H, K, generator=g) - 2.0)
    else:
        gate = F.logsigmoid(torch.randn(1, T, H, K, generator=g) + 4.0)
    beta = torch.rand(1, T, H, generator=g)
    ours = lambda: chunk_kda(q, k, v, gate, beta)
    theirs = lambda: chunk_kimi_delta_attention(q, k, v, gate, beta, output_final_state=True)
    (o1, s1), (o2, s2) = ours(), theirs()
    return (*_time_pair(ours, theirs, reps), max(_rel(o1, o2), _rel(s1, s2)))


def bench_mamba2(T, H, N, P, reps):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, H, P, generator=g)
    dt = F.softplus(torch.randn(1, T, H, generator=g) - 2.0)
    A = -torch.empty(H).uniform_(1, 16, generator=g)
    Bm = torch.randn(1, T, 1, N, generator=g)
    Cm = torch.randn(1, T, 1, N, generator=g)

    def ours():
        return chunk_mamba2(Cm, Bm, x * dt[..., None], dt * A, scale=1.0)

    def theirs():
        return mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=64, return_final_states=True)

    (o1, s1), (o2, s2) = ours(), theirs()
    return (*_time_pair(ours, theirs, reps), max(_rel(o1, o2), _rel(s1, s2.transpose(-1, -2))))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="bench/results/linear_attn.json")
    ap.add_argument("--quick", action="store_true", help="one small shape per family")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="cpu",
                    help="cpu: process CPU time (robust when other jobs share the cores; use with 1 thread)")
    a = ap.parse_args(argv)
    global _clock
    _clock = CLOCK[a.clock]
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    shapes = [(4, 64, 64), (8, 128, 128)] if a.quick else [(4, 64, 64), (4, 128, 128), (8, 64, 64), (8, 128, 128)]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.clock} clock, T={a.T}, B=1, fp32, "
          f"load avg {os.getloadavg()[0]:.2f}")
    hdr = f"{'family':<14}{'H':>3}{'K':>5}{'V':>5}{'ours ms':>10}{'theirs ms':>11}{'speedup':>9}{'rel diff':>10}  vs"
    print(hdr)
    print("-" * len(hdr))
    cases = []
    for H, K, V in shapes:
        cases.append(("gated_deltanet", H, K, V, lambda H=H, K=K, V=V: bench_gdn(a.T, H, K, V, a.reps), "qwen3_5 torch_chunk_gated_delta_rule"))
        cases.append(("kda", H, K, V, lambda H=H, K=K, V=V: bench_kda(a.T, H, K, V, a.reps), "kimi_linear chunk_kimi_delta_attention"))
        cases.append(("kda(strong g)", H, K, V, lambda H=H, K=K, V=V: bench_kda(a.T, H, K, V, a.reps, strong=True), "kimi_linear chunk_kimi_delta_attention"))
        cases.append(("mamba2", H, K, V, lambda H=H, K=K, V=V: bench_mamba2(a.T, H, K, V, a.reps), "nemotron_h mamba2_chunk_scan (N=K, P=V)"))
    for name, H, K, V, fn, ref in cases:
        t_ours, t_theirs, d = fn()
        rows.append(dict(family=name, T=a.T, H=H, K=K, V=V, ours_s=t_ours, theirs_s=t_theirs,
                         speedup=t_theirs / t_ours, rel_diff=d, reference=ref))
        print(f"{name:<14}{H:>3}{K:>5}{V:>5}{t_ours*1e3:>10.1f}{t_theirs*1e3:>11.1f}{t_theirs/t_ours:>8.2f}x{d:>10.1e}  {ref}")
    if a.json:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), clock=a.clock, T=a.T,
                           loadavg=os.getloadavg()[0], rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
