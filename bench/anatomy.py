"""Anatomy of a warm request: the mesh's per-hop breakdown against the all-hit floor.

    python -m bench.anatomy [--segments 8 --seg-tokens 512] [--reps 9] [--no-nixl]
                            [--random-model hidden=1024,layers=16,ratio=3:1 | --random-model '']

For the bundled model and a random-weight model of a realistic shape (timing only), one run:
1. starts the mesh (hypic.launcher.Mesh: segcache, one scatter, combine, router; 1 torch thread
   per process), sends one request of `segments` random segments so that their entries are
   built and stored, then the same request `reps` times warm (every segment a segcache hit);
2. prints the median client TTFT and the `Timings` the SDK returns (lookup, transfer, compose,
   seams, query prefill, server TTFT) and the rest (router + gRPC + tokens out);
3. measures the all-hit floor in this process, once after each warm request (both see the same
   load on a shared machine): the entries' bytes at memcpy speed (np.copyto
   into a pre-faulted buffer) + the seam and query tokens at prefill speed (a plain forward of
   `seg-tokens` tokens, per token) -- what a request cannot beat on this machine with every
   entry cached; and reports warm TTFT / floor. Beside it, the seam and query tokens as one
   plain forward: on a tiny model a forward's fixed per-call cost exceeds the floor itself.
Writes bench/results/anatomy.json (timestamps, load average and the labels with it).
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

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hypic  # noqa: E402
from bench.driver import median  # noqa: E402
from bench.random_model import RANDOM_LABEL, describe, parse_spec, save_random_model  # noqa: E402
from common.engine.hybrid_engine import HybridEngine  # noqa: E402
from hypic.launcher import DEFAULT_MODEL, Mesh  # noqa: E402

HOPS = ("lookup_s", "transfer_s", "compose_s", "seams_s", "query_prefill_s", "ttft_s")


def prompt(vocab: int, n: int, tokens: int, query: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(10, vocab, (tokens,), generator=g).tolist() for _ in range(n)]
    return segs, torch.randint(10, vocab, (query,), generator=g).tolist()


def mesh_anatomy(model: Path, segs, query, reps: int, nixl: bool, floor: "Floor") -> dict:
    """The warm request through the mesh `reps` times, one floor measurement after each (so that
    both see the same load on a shared machine)."""
    flags = [] if nixl else ["--no-nixl"]
    with tempfile.TemporaryDirectory(prefix="hypic-anatomy-") as d, \
            Mesh(model, d, n_scatter=1, threads=1, start_timeout_s=600,
                 extra_args={"segcache": flags, "combine": flags,
                             # the request may be longer than the router's default budget (8 x 512 + 16)
                             "router": ["--max-prompt-tokens", str(max(4096, sum(map(len, segs)) + len(query)))]}
                 ) as mesh:
        with hypic.Client(mesh.router_address, timeout=600) as client:
            t = time.perf_counter()
            cold = client.generate(segs, query, max_tokens=1, stream=False)
            cold_s = time.perf_counter() - t
            time.sleep(1.0)  # the entries' stores to segcache finish in the background
            runs = []
            for _ in range(reps):
                t = time.perf_counter()
                stream = client.generate(segs, query, max_tokens=1)
                first = None
                for _tok in stream:
                    first = first or time.perf_counter()
                tm = stream.timings
                runs.append(dict(client_ttft_s=first - t, hits=tm.hits, segments=tm.segments,
                                 via_nixl=sum(s.via_nixl for s in tm.trace), tiers=dict(tm.hits_by_tier),
                                 **{h: getattr(tm, h) for h in HOPS}))
                floor.measure()
    out = {k: median([r[k] for r in runs]) for k in ("client_ttft_s", *HOPS)}
    out.update(cold_ttft_s=cold_s, cold_hits=cold.timings.hits if cold.timings else None,
               hits=min(r["hits"] for r in runs), segments=runs[0]["segments"],
               via_nixl=min(r["via_nixl"] for r in runs), tiers=runs[-1]["tiers"], reps=reps)
    return out


class Floor:
    """Entry bytes at memcpy speed + seam and query tokens at prefill speed, in this process
    (1 torch thread, as each mesh process)."""

    def __init__(self, model: Path, segs, query, seam: int):
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        self.eng = HybridEngine.from_pretrained(model)
        self.segment = segs[0]
        self.entry_bytes = len(self.eng.build_entry(segs[0], seam).to_bytes()) * len(segs)  # same-length segments
        self.src = np.random.default_rng(0).integers(0, 256, self.entry_bytes, dtype=np.uint8)
        self.dst = np.ones_like(self.src)  # pre-faulted
        # the same tokens as one small forward: what a model this size costs per call
        self.seam_query = [t for s in segs for t in s[:seam]] + list(query)
        self.eng.forward(self.segment)
        self.copy: list[float] = []
        self.fwd: list[float] = []
        self.one: list[float] = []

    def measure(self) -> None:
        for out, fn in ((self.copy, lambda: np.copyto(self.dst, self.src)),
                        (self.fwd, lambda: self.eng.forward(self.segment)),
                        (self.one, lambda: self.eng.forward(self.seam_query))):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)

    def result(self) -> dict:
        copy, per_token = median(self.copy), median(self.fwd) / len(self.segment)
        tokens = len(self.seam_query)
        return dict(entry_bytes=self.entry_bytes, memcpy_s=copy, memcpy_gbps=self.entry_bytes / copy / 1e9,
                    prefill_per_token_s=per_token, seam_query_tokens=tokens, tokens_s=tokens * per_token,
                    floor_s=copy + tokens * per_token, seam_query_one_forward_s=median(self.one),
                    reps=len(self.copy))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="'' to skip")
    ap.add_argument("--random-model", default="hidden=1024,layers=16,ratio=3:1", help="'' to skip")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--seg-tokens", type=int, default=512)
    ap.add_argument("--query-tokens", type=int, default=16)
    ap.add_argument("--seam", type=int, default=8, help="the mesh's seam (Mesh default)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-nixl", action="store_true", help="segcache and combine without NIXL")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "anatomy.json")
    args = ap.parse_args(argv)
    results = dict(command="python -m bench.anatomy " + " ".join(argv if argv is not None else sys.argv[1:]),
                   segments=args.segments, seg_tokens=args.seg_tokens, query_tokens=args.query_tokens,
                   nixl=not args.no_nixl, reps=args.reps,
                   machine=dict(cpus=os.cpu_count(), platform=platform.platform(), loadavg_start=os.getloadavg(),
                                torch_threads_per_process=1),
                   models=[])
    with tempfile.TemporaryDirectory(prefix="hypic-anatomy-model-") as tmp:
        models = [(Path(args.model), Path(args.model).name, None)] if args.model else []
        if args.random_model:
            spec = parse_spec(args.random_model)
            models.append((save_random_model(spec, Path(tmp) / "random", tokenizer_from=DEFAULT_MODEL),
                           describe(spec), RANDOM_LABEL))
        for path, label, random_label in models:
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            segs, query = prompt(vocab, args.segments, args.seg_tokens, args.query_tokens, seed=7)
            print(f"== {label}", flush=True)
            fl = Floor(path, segs, query, args.seam)
            mesh = mesh_anatomy(path, segs, query, args.reps, nixl=not args.no_nixl, floor=fl)
            fl = fl.result()
            row = dict(model=label, random_weights=random_label, mesh=mesh, floor=fl,
                       ttft_over_floor=mesh["client_ttft_s"] / fl["floor_s"])
            results["models"].append(row)
            report(row)
    results["machine"]["loadavg_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    return results


def report(row: dict) -> None:
    m, f = row["mesh"], row["floor"]
    ms = lambda s: f"{1e3 * s:8.1f} ms"  # noqa: E731
    rest = m["client_ttft_s"] - m["ttft_s"]
    print(f"  warm: {m['hits']}/{m['segments']} hits ({m['via_nixl']} via NIXL, tiers {m['tiers']}), "
          f"cold TTFT {ms(m['cold_ttft_s']).strip()}")
    for name in HOPS:
        print(f"  {name:<18}{ms(m[name])}")
    print(f"  {'router+rpc+out':<18}{ms(rest)}   (client TTFT - server TTFT)")
    print(f"  {'client TTFT':<18}{ms(m['client_ttft_s'])}")
    print(f"  floor: {f['entry_bytes'] / 2**20:.1f} MiB at memcpy {f['memcpy_gbps']:.2f} GB/s = "
          f"{ms(f['memcpy_s']).strip()}"
          f" + {f['seam_query_tokens']} tokens at {1e3 * f['prefill_per_token_s']:.3f} ms = "
          f"{ms(f['tokens_s']).strip()} -> {ms(f['floor_s']).strip()}")
    print(f"  (the {f['seam_query_tokens']} tokens as one plain forward: {ms(f['seam_query_one_forward_s']).strip()})")
    print(f"  warm TTFT / floor = {row['ttft_over_floor']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
