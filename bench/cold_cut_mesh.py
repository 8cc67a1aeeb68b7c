"""Cold TTFT on the real mesh, cut vs whole (`python -m bench.cold_cut_mesh`, a few minutes):
m = 2 scatter workers, requests of two fresh documents (never seen: every piece a miss) whose
longer one is 4× the other, sent alternately with keep_whole (the long document is one build,
the last to arrive) and without (the router cuts it at --cut-tokens into pieces the planner
spreads over both workers). Writes bench/results/cold_cut_mesh.json: every TTFT (the router's
own, Timings.ttft_s) and the medians' ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import hypic
from hypic.launcher import DEFAULT_MODEL, Mesh

RESULTS = Path(__file__).resolve().parent / "results"


def measure(model: Path, short: int, reps: int, cut_tokens: int, seed: int) -> dict:
    g = random.Random(seed)
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 256)
    ttft: dict[str, list[float]] = {"whole": [], "cut": []}
    with tempfile.TemporaryDirectory() as data, \
            Mesh(model, data, n_scatter=2, threads=1,
                 extra_args={"router": ["--cut-tokens", str(cut_tokens)]}) as mesh, \
            hypic.Client(mesh.router_address, timeout=300) as c:
        def ask(keep_whole: bool):
            docs = [[g.randrange(1, vocab) for _ in range(n)] for n in (4 * short, short)]
            return c.generate(segments=docs, query=[1, 2, 3], max_tokens=1, stream=False,
                              keep_whole=keep_whole).timings
        ask(False), ask(True)   # first calls (channels, code paths)
        for r in range(reps):
            for keep in ((True, False) if r % 2 == 0 else (False, True)):
                t = ask(keep)
                assert t.misses == t.segments, "a cold request hit the cache"
                ttft["whole" if keep else "cut"].append(t.ttft_s)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    return dict(m=2, documents_tokens=[4 * short, short], cut_tokens=cut_tokens, reps=reps,
                ttft_s=ttft, ttft_p50_s=med, speedup_cut_vs_whole=med["whole"] / med["cut"])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--short", type=int, default=512, help="the shorter document's tokens (the other: 4x)")
    ap.add_argument("--cut-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "cold_cut_mesh.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = measure(args.model, args.short, args.reps, args.cut_tokens, args.seed)
    res.update(command="python -m bench.cold_cut_mesh", model=str(args.model), wall_s=time.perf_counter() - t0)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"m=2, documents {res['documents_tokens']}: TTFT p50 whole {res['ttft_p50_s']['whole']:.3f} s, "
          f"cut at {args.cut_tokens} {res['ttft_p50_s']['cut']:.3f} s: x{res['speedup_cut_vs_whole']:.2f}")


if __name__ == "__main__":
    main()
