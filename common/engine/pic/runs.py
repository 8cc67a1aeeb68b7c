"""Which arrived segments a combine worker composes next (docs/combine.md, step 6).

Segments arrive in any order (scatter builds finish when they finish); composition goes in
prompt order, since a segment's seam needs the state of everything before it. Whenever the
worker is free it takes the *run* of consecutive segments in hand from the next one to compose
and extends the state by all of them in one layer-major pass (common.engine.pic.reuse.compose_run).
"""
from __future__ import annotations

from typing import Collection, Iterable, Iterator


def arrived_run(ready: Collection[int], nxt: int, n: int) -> range:
    """The run nxt, nxt+1, ... of segments in `ready` (empty when nxt has not arrived)."""
    end = nxt
    while end < n and end in ready:
        end += 1
    return range(nxt, end)


def runs_as_arriving(batches: Iterable[Iterable[int]], n: int) -> Iterator[range]:
    """The runs a worker composes when the segments arrive in `batches` (each: the indices that
    arrived while it was busy with the previous run) — the in-process replay of combine's loop,
    for tests and benchmarks. Every segment ends up in exactly one run, in prompt order."""
    ready: set[int] = set()
    nxt = 0
    for batch in batches:
        ready.update(batch)
        run = arrived_run(ready, nxt, n)
        if len(run):
            yield run
            nxt = run.stop
    if nxt != n:
        raise ValueError(f"segments {nxt}..{n - 1} never arrived")
