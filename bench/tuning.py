"""The figures docs/tuning.md found nowhere else: torch threads per model process, the seam
width's cost, and the memory of each process of a mesh.

    nice -n 10 python -m bench.tuning [--reps 5] [--no-mesh]

One process, the bundled model, wall clock; the variants alternate rep by rep, so that all of them
see the same load on a shared machine (compare ratios within one run, never across runs):
1. threads: torch intra-op threads 1 and 2 (torch.set_num_threads between calls) on what each
   model process computes: a scatter build (build_entry of one segment of --build-tokens), a
   combine's hypic prefill of --segments cached segments of --seg-tokens plus a query of
   --query-tokens (layer-major, as combine composes);
2. seam width: the same hypic prefill at w = --seams (each with entries built at that w), one
   thread: its time against w and against full recompute of the same prompt (one thread), and
   the bytes of one entry;
3. memory: this process's VmRSS with torch and the model loaded; unless --no-mesh, every
   service's VmRSS in a running mesh (hypic.launcher.Mesh: segcache, one scatter, one combine,
   the router; 1 thread each) after one cold and one warm request of 8 segments of 480 tokens
   (the bundled model's limit is 4,096 prompt tokens).
Writes bench/results/tuning.json (the command, the load average at the start and the end).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.driver import median
from common.engine.hybrid_engine import HybridEngine
from hypic.launcher import DEFAULT_MODEL, Mesh

REPO = Path(__file__).resolve().parents[1]
THREADS = (1, 2)


def rss_mib(pid: int | str = "self") -> float:
    """Resident set size of a process, MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def random_ids(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=gen).tolist()


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def threads_and_seams(eng: HybridEngine, args) -> dict:
    """Sections 1 and 2: every variant once per rep, in turn; medians."""
    gen = torch.Generator().manual_seed(0)
    segs = [random_ids(eng.vocab_size, args.seg_tokens, gen) for _ in range(args.segments)]
    query = random_ids(eng.vocab_size, args.query_tokens, gen)
    build_seg = random_ids(eng.vocab_size, args.build_tokens, gen)
    entries = {w: [eng.build_entry(s, w) for s in segs] for w in args.seams}

    def hypic(w: int):
        return lambda: eng.prefill_segments(segs, query, entries=entries[w], mode="hypic", seam=w,
                                            order="layer")

    def full():
        return eng.prefill_segments(segs, query, mode="full")

    work = {"scatter_build": lambda: eng.build_entry(build_seg, 8), "combine_hypic": hypic(8)}
    times: dict[str, list[float]] = {}
    for fn in [*work.values(), full, *(hypic(w) for w in args.seams)]:
        fn()  # warm-up: allocator, first-call costs
    for _ in range(args.reps):
        for t in THREADS:
            torch.set_num_threads(t)
            for name, fn in work.items():
                times.setdefault(f"{name}@{t}", []).append(seconds(fn))
        torch.set_num_threads(1)
        times.setdefault("full_recompute", []).append(seconds(full))
        for w in args.seams:
            times.setdefault(f"seam_{w}", []).append(seconds(hypic(w)))
    med = {k: median(v) for k, v in times.items()}
    threads = [dict(work=name, **{f"threads_{t}_s": med[f"{name}@{t}"] for t in THREADS},
                    speedup_2_over_1=med[f"{name}@1"] / med[f"{name}@2"]) for name in work]
    full = med["full_recompute"]
    seams = [dict(seam=w, hypic_s=med[f"seam_{w}"], over_seam_8=med[f"seam_{w}"] / med["seam_8"],
                  full_over_hypic=full / med[f"seam_{w}"], recomputed_tokens=args.segments * w + args.query_tokens,
                  entry_bytes=len(entries[w][0].to_bytes())) for w in args.seams]
    return dict(threads=threads, seams=seams, full_recompute_1_thread_s=full, samples=times)


def mesh_memory(model: Path, eng: HybridEngine) -> dict:
    """Section 3's mesh: VmRSS of every service after a cold and a warm request."""
    import hypic  # the SDK, only for this section

    gen = torch.Generator().manual_seed(1)
    segs = [random_ids(eng.vocab_size, 480, gen) for _ in range(8)]  # 3,856 tokens: under 4,096
    query = random_ids(eng.vocab_size, 16, gen)
    with tempfile.TemporaryDirectory(prefix="hypic-tuning-") as d, \
            Mesh(model, d, n_scatter=1, threads=1, start_timeout_s=600) as mesh:
        idle = {name: rss_mib(mesh[name].pid) for name in mesh.names}
        with hypic.Client(mesh.router_address, timeout=600) as client:
            client.generate(segs, query, max_tokens=1, stream=False)
            time.sleep(1.0)  # the entries' stores to segcache finish in the background
            warm = client.generate(segs, query, max_tokens=1, stream=False)
        after = {name: rss_mib(mesh[name].pid) for name in mesh.names}
        return dict(rss_idle_mib=idle, rss_after_mib=after, warm_hits=warm.timings.hits,
                    request=dict(segments=8, seg_tokens=480, query_tokens=16))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--seg-tokens", type=int, default=512)
    ap.add_argument("--query-tokens", type=int, default=16)
    ap.add_argument("--build-tokens", type=int, default=1024)
    ap.add_argument("--seams", type=int, nargs="+", default=[0, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-mesh", action="store_true", help="skip the mesh's memory (section 3)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tuning.json")
    args = ap.parse_args(argv)
    if 8 not in args.seams:
        ap.error("--seams must include 8 (the default, the reference of the ratios)")
    started = time.perf_counter()
    res = dict(command=" ".join(["python -m bench.tuning", *(argv if argv is not None else sys.argv[1:])]),
               model=str(args.model.resolve().relative_to(REPO)) if args.model.resolve().is_relative_to(REPO)
               else str(args.model),
               machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_start=os.getloadavg(),
                            nice=os.nice(0)),
               request=dict(segments=args.segments, seg_tokens=args.seg_tokens, query_tokens=args.query_tokens,
                            build_tokens=args.build_tokens, reps=args.reps))
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    eng = HybridEngine.from_pretrained(args.model)
    res["rss_engine_process_mib"] = rss_mib()
    res.update(threads_and_seams(eng, args))
    if not args.no_mesh:
        res["mesh"] = mesh_memory(args.model, eng)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - started
    report(res)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return res


def report(res: dict) -> None:
    ms = lambda s: f"{1e3 * s:8.1f} ms"  # noqa: E731
    print(f"load average {res['machine']['loadavg_start'][0]:.1f} -> {res['machine']['loadavg_end'][0]:.1f}")
    for row in res["threads"]:
        print(f"{row['work']:<16} 1 thread {ms(row['threads_1_s'])}  2 threads {ms(row['threads_2_s'])}"
              f"  x{row['speedup_2_over_1']:.2f}")
    for row in res["seams"]:
        print(f"seam {row['seam']:>3}: hypic {ms(row['hypic_s'])} (x{row['over_seam_8']:.2f} of seam 8; "
              f"full recompute / hypic x{row['full_over_hypic']:.1f}), entry {row['entry_bytes']} B")
    print(f"RSS of this process (torch + model): {res['rss_engine_process_mib']:.0f} MiB")
    for name, mib in res.get("mesh", {}).get("rss_after_mib", {}).items():
        print(f"  {name:<10} {mib:6.0f} MiB")


if __name__ == "__main__":
    main()
