"""Our chunked torch linear attention vs transformers' own torch fallbacks, side by side (CPU).

    python -m bench.linear_attn [--T 2048] [--reps 3] [--json bench/results/linear_attn.json]

Compared, for the same shapes and inputs (fp32, B = 1): "engine" is our family wrapper (the same path
``linear_attention`` takes: chunk 32 for the delta families on CPU, 64 otherwise), "chunk64" our
``chunk_linear_attn`` at chunk size 64 (transformers' chunk size), "theirs" the transformers function:
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
import functools
import json
import os

import torch
import torch.nn.functional as F

from bench.driver import CLOCKS, add_clock_arg, best_of
from kernels.linear_attn.chunk import chunk_gated_deltanet, chunk_kda, chunk_linear_attn, chunk_mamba2
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule


def _run(engine, ours64, theirs, time_fns, S_theirs_T=False):
    """(best times of the three, the larger relative difference of their outputs and final states)."""
    (o1, s1), (o2, s2) = engine(), theirs()
    if S_theirs_T:
        s2 = s2.transpose(-1, -2)
    t = time_fns({"engine": engine, "ours64": ours64, "theirs": theirs})
    return t, max(_rel(o1, o2), _rel(s1, s2))


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench_gdn(T, H, K, V, time_fns):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=g)
    k = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(1, T, H, generator=g) + 3.0)
    beta = torch.rand(1, T, H, generator=g)
    engine = lambda: chunk_gated_deltanet(q, k, v, gate, beta)  # == linear_attention("gated_deltanet", ...)
    ours64 = lambda: chunk_linear_attn(q, k, v, gate, beta, delta=True, chunk_size=64)
    theirs = lambda: torch_chunk_gated_delta_rule(q, k, v, gate, beta, output_final_state=True)
    return _run(engine, ours64, theirs, time_fns)


def bench_kda(T, H, K, V, time_fns, strong=False):
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
    engine = lambda: chunk_kda(q, k, v, gate, beta)  # == linear_attention("kda", ...)
    ours64 = lambda: chunk_linear_attn(q, k, v, gate, beta, delta=True, chunk_size=64)
    theirs = lambda: chunk_kimi_delta_attention(q, k, v, gate, beta, output_final_state=True)
    return _run(engine, ours64, theirs, time_fns)


def bench_mamba2(T, H, N, P, time_fns):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, H, P, generator=g)
    dt = F.softplus(torch.randn(1, T, H, generator=g) - 2.0)
    A = -torch.empty(H).uniform_(1, 16, generator=g)
    Bm = torch.randn(1, T, 1, N, generator=g)
    Cm = torch.randn(1, T, 1, N, generator=g)

    def engine():
        return chunk_mamba2(Cm, Bm, x * dt[..., None], dt * A)  # == linear_attention("mamba2", ...)

    def ours64():
        return chunk_linear_attn(Cm, Bm, x * dt[..., None], dt * A, scale=1.0, chunk_size=64)

    def theirs():
        return mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=64, return_final_states=True)

    return _run(engine, ours64, theirs, time_fns, S_theirs_T=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="bench/results/linear_attn.json")
    ap.add_argument("--quick", action="store_true", help="one small shape per family")
    ap.add_argument("--threads", type=int, default=1)
    add_clock_arg(ap)
    a = ap.parse_args(argv)
    time_fns = functools.partial(best_of, reps=a.reps, clock=CLOCKS[a.clock])
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    shapes = [(4, 64, 64), (8, 128, 128)] if a.quick else [(4, 64, 64), (4, 128, 128), (8, 64, 64), (8, 128, 128)]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.clock} clock, T={a.T}, B=1, fp32, "
          f"load avg {os.getloadavg()[0]:.2f}")
    hdr = (f"{'family':<14}{'H':>3}{'K':>5}{'V':>5}{'engine ms':>11}{'chunk64 ms':>12}{'theirs ms':>11}"
           f"{'engine x':>10}{'chunk64 x':>11}{'rel diff':>10}  vs")
    print(hdr)
    print("-" * len(hdr))
    cases = []
    for H, K, V in shapes:
        cases.append(("gated_deltanet", H, K, V, lambda H=H, K=K, V=V: bench_gdn(a.T, H, K, V, time_fns), "qwen3_5 torch_chunk_gated_delta_rule"))
        cases.append(("kda", H, K, V, lambda H=H, K=K, V=V: bench_kda(a.T, H, K, V, time_fns), "kimi_linear chunk_kimi_delta_attention"))
        cases.append(("kda(strong g)", H, K, V, lambda H=H, K=K, V=V: bench_kda(a.T, H, K, V, time_fns, strong=True), "kimi_linear chunk_kimi_delta_attention"))
        cases.append(("mamba2", H, K, V, lambda H=H, K=K, V=V: bench_mamba2(a.T, H, K, V, time_fns), "nemotron_h mamba2_chunk_scan (N=K, P=V)"))
    for name, H, K, V, fn, ref in cases:
        t, d = fn()
        rows.append(dict(family=name, T=a.T, H=H, K=K, V=V, engine_s=t["engine"], chunk64_s=t["ours64"],
                         theirs_s=t["theirs"], speedup_engine=t["theirs"] / t["engine"],
                         speedup_chunk64=t["theirs"] / t["ours64"], rel_diff=d, reference=ref))
        print(f"{name:<14}{H:>3}{K:>5}{V:>5}{t['engine']*1e3:>11.1f}{t['ours64']*1e3:>12.1f}{t['theirs']*1e3:>11.1f}"
              f"{t['theirs']/t['engine']:>9.2f}x{t['theirs']/t['ours64']:>10.2f}x{d:>10.1e}  {ref}")
    if a.json:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), clock=a.clock, T=a.T,
                           loadavg=os.getloadavg()[0], rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
