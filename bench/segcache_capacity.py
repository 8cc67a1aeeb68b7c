"""Hit rate vs host-tier capacity for 1, 2, 4 segcache instances on the RAG trace.

    python -m bench.segcache_capacity [--requests 3000] [--out bench/results]

The entry formats at equal budgets are a study of their own on this trace and these simulated
tiers: `python -m bench.segcache_capacity_formats` (segcache_capacity_formats.json).

The RAG trace of bench/workloads.py (a Zipf-popular corpus, 4-32 documents per request, cut to
the prompt budget) is replayed against k simulated host tiers: each document's key is placed on
its instance by the clients' own rendezvous hashing (common/mesh/segcache_ring.owner) and each
instance evicts with segcache's own GDSF policy (services/segcache/policy.py) within its budget.
An entry's size is the bundled model's state for the document's tokens (bench.driver.Encoder:
full-attention KV + recurrent and conv state) and its cost its tokens (recompute is linear).

The capacity axis is one instance's budget as a fraction of the corpus's entry bytes; k instances
hold k times that. If the capacity adds up (placement spreads the keys evenly and no key is held
twice), k instances of budget c hit like one instance of budget k*c: the curves over *total*
capacity lie on each other. Hit rates are counted after a warm-up (the first --warm requests),
per segment lookup and per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import workloads as W  # noqa: E402
from bench.driver import Encoder  # noqa: E402
from bench.plots import pyplot  # noqa: E402
from common.mesh.segcache_ring import owner  # noqa: E402
from hypic.launcher import DEFAULT_MODEL  # noqa: E402
from services.segcache.policy import make_policy  # noqa: E402

INSTANCES = (1, 2, 4)
FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)


class SimTier:
    """One instance's host tier, run as SegmentStore runs it when its LMDB holds every entry
    (tests/bench/test_segcache_capacity.py replays random traces through both): a new key is put with
    frequency 1; every later read counts one more hit (GDSF frequency = hits + 1, kept while the
    entry is only on disk); a read of a key not in the host tier promotes it from disk; an insert
    evicts victims until the new entry fits, then adds it; an entry over the budget stays on
    disk only."""

    def __init__(self, capacity: int, policy: str = "gdsf"):
        self.capacity = capacity
        self.policy = make_policy(policy)
        self.sizes: dict[str, int] = {}   # in the host tier
        self.freq: dict[str, int] = {}    # every key ever put (LMDB remembers it)
        self.bytes = 0

    def access(self, key: str, size: int, cost: float) -> bool:
        """One read (a put when the key is new); True when the host tier answered."""
        if key in self.sizes:
            self.freq[key] += 1
            self.policy.touch(key, self.freq[key])
            return True
        self.freq[key] = self.freq[key] + 1 if key in self.freq else 1
        if size <= self.capacity:
            while self.bytes + size > self.capacity:  # room first, as SegmentStore._make_room
                self.bytes -= self.sizes.pop(self.policy.pop_victim())
            self.sizes[key] = size
            self.policy.add(key, size, cost, self.freq[key])
            self.bytes += size
        return False


def replay(trace: W.Trace, sizes: dict[int, int], n_instances: int, capacity: int,
           warm: int) -> dict:
    addrs = [f"10.0.0.{i + 1}:50061" for i in range(n_instances)]
    tiers = {a: SimTier(capacity) for a in addrs}
    place = {d: owner(f"doc-{d}", addrs) for d in sizes}
    hits = lookups = hit_tokens = tokens = 0
    for r in trace.requests:
        for doc, seg in zip(r.doc_ids, r.segments):
            hit = tiers[place[doc]].access(f"doc-{doc}", sizes[doc], float(len(seg)))
            if r.index >= warm:
                lookups += 1
                tokens += len(seg)
                hits += hit
                hit_tokens += len(seg) if hit else 0
    held = [t.bytes for t in tiers.values()]
    return {"instances": n_instances, "capacity_bytes": capacity,
            "total_capacity_bytes": capacity * n_instances,
            "hit_rate": hits / max(lookups, 1), "token_hit_rate": hit_tokens / max(tokens, 1),
            "held_bytes_max_over_mean": max(held) / max(sum(held) / len(held), 1)}


def rag(args: argparse.Namespace) -> tuple[list, W.Trace]:
    """The corpus and the RAG trace of the arguments (the same for every study of this bench)."""
    corpus = W.make_corpus(args.corpus, tuple(args.doc_tokens), seed=args.seed * 1000 + 1)
    pop = W.Popularity(len(corpus), args.zipf_s, seed=args.seed * 1000 + 3)
    trace = W.rag_trace(corpus, args.requests, seed=args.seed * 1000 + 20, k=tuple(args.k),
                        zipf_s=args.zipf_s, max_prompt_tokens=args.max_prompt_tokens, popularity=pop)
    return corpus, trace


def run(args: argparse.Namespace) -> dict:
    enc = Encoder(Path(args.model) if args.model else DEFAULT_MODEL)
    corpus, trace = rag(args)
    sizes = {d.id: enc.state_bytes(d.n_tokens) for d in corpus}
    corpus_bytes = sum(sizes.values())
    rows = []
    for k in INSTANCES:
        for f in FRACTIONS:
            row = replay(trace, sizes, k, int(f * corpus_bytes), args.warm)
            rows.append({"capacity_fraction": f, "total_capacity_fraction": f * k, **row})
    return {"bench": "segcache_capacity", "corpus_docs": len(corpus), "corpus_bytes": corpus_bytes,
            "requests": len(trace), "warm": args.warm, "trace": trace.summary(), "policy": "gdsf",
            "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def table(result: dict) -> str:
    rows = result["rows"]
    lines = [f"hit rate (per segment lookup) vs one instance's host-tier budget "
             f"(fraction of the corpus's {result['corpus_bytes'] / 2**20:.0f} MiB of entries); "
             f"RAG trace, {result['requests']} requests, GDSF",
             f"{'budget/instance':>16} " + " ".join(f"{f'k={k}':>8}" for k in INSTANCES)
             + "   | total budget = k x budget; k=1 at the same total:"]
    by = {(r["instances"], r["capacity_fraction"]): r for r in rows}
    one = {r["capacity_fraction"]: r["hit_rate"] for r in rows if r["instances"] == 1}
    for f in FRACTIONS:
        cells = " ".join(f"{by[(k, f)]['hit_rate']:>8.3f}" for k in INSTANCES)
        same_total = " ".join(f"k={k}:{one[f * k]:.3f}" if f * k in one else f"k={k}:   -"
                              for k in INSTANCES[1:])
        lines.append(f"{f:>16.4f} {cells}   | {same_total}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for k in INSTANCES:
        rs = [r for r in result["rows"] if r["instances"] == k]
        hits = [r["hit_rate"] for r in rs]
        axes[0].plot([r["capacity_fraction"] for r in rs], hits, "o-", label=f"{k} instance(s)")
        axes[1].plot([r["total_capacity_fraction"] for r in rs], hits, "o-", label=f"{k} instance(s)")
    axes[0].set_xlabel("host-tier budget per instance (fraction of corpus entry bytes)")
    axes[1].set_xlabel("total budget, k x per instance (fraction of corpus entry bytes)")
    axes[0].set_ylabel("hit rate (segment lookups)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"RAG trace ({result['requests']} requests, {result['corpus_docs']} docs): "
                 "rendezvous placement + GDSF per instance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="", help="model whose state sizes set entry bytes "
                    "(default: the bundled one)")
    ap.add_argument("--corpus", type=int, default=400)
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[128, 2048])
    ap.add_argument("--k", type=int, nargs=2, default=[4, 32])
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--warm", type=int, default=500, help="requests before counting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transfer-gbps", type=float, default=None,
                    help="bench.segcache_capacity_formats: read rate for transfer times (default: bench/results/segcache.json's)")


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    print(table(result))
    (args.out / "segcache_capacity.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "segcache_capacity.png")
    print(f"wrote {args.out}/segcache_capacity.json, segcache_capacity.png")
    return result


if __name__ == "__main__":
    main()
