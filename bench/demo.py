"""`make demo`: start the mesh on the bundled model and answer a small RAG session through it.

Eight documents are retrieved for every question, in a different order each time (as a retriever
returns them). The first question finds the cache cold (scatter builds every document), later ones
find it warm (segcache hits composed in constant time); each answer is also recomputed in full for
comparison. Prints the answers and TTFT cold vs warm vs full recompute.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import hypic
from bench.quality.tasks import eval_prompt, make_query
from hypic.launcher import DEFAULT_MODEL, Mesh


def _session(n_questions: int):
    """(documents as text, [(question text, expected answer)]) from the quality tasks' language."""
    world, _ = eval_prompt("retrieval", 0)
    rng = random.Random(7)
    questions = []
    for _ in range(n_questions):
        q = make_query(rng, world, "retrieval")
        questions.append((" ".join(q.words), " ".join(q.answer)))
    return [" ".join(d) for d in world.docs], questions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--scatter", type=int, default=2)
    ap.add_argument("--questions", type=int, default=5)
    args = ap.parse_args(argv)

    if not (Path(args.model) / "config.json").exists():
        print(f"no model at {args.model} (train one with bench/quality/train.py)")
        return 2
    docs, questions = _session(args.questions)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as data:
        print(f"starting the mesh (segcache, {args.scatter} scatter, combine, router) on {args.model} ...")
        with Mesh(args.model, data, n_scatter=args.scatter, threads=1) as mesh:
            print(f"router at {mesh.router_address}\n")
            ttft = {"cold": [], "warm": [], "full": []}
            with hypic.Client(mesh.router_address, timeout=300) as client:
                print(f"{'question':<28}{'expected':<10}{'hypic':<10}{'full':<10}{'cache':<7}"
                      f"{'TTFT hypic':>11}{'TTFT full':>11}")
                for i, (question, expected) in enumerate(questions):
                    order = docs[:]
                    rng.shuffle(order)
                    hyp = client.generate(segments=order, query=question, max_tokens=1, stream=False)
                    full = client.generate(segments=order, query=question, max_tokens=1, stream=False, mode="full")
                    kind = "cold" if hyp.timings.misses else "warm"
                    ttft[kind].append(hyp.timings.ttft_s)
                    ttft["full"].append(full.timings.ttft_s)
                    print(f"{question:<28}{expected:<10}{hyp.text.strip():<10}{full.text.strip():<10}{kind:<7}"
                          f"{hyp.timings.ttft_s * 1e3:>9.1f}ms{full.timings.ttft_s * 1e3:>9.1f}ms")
            med = {k: statistics.median(v) * 1e3 for k, v in ttft.items() if v}
            print("\nTTFT (median): " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
            if "warm" in med:
                print(f"full recompute / warm hypic TTFT: {med['full'] / med['warm']:.2f}x on "
                      f"{sum(len(d.split()) for d in docs)} prompt words (CPU; on a model this small "
                      f"per-request overheads dominate — bench/serve.py and bench/reuse.py measure more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
