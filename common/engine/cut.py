"""The cut rule: a segment longer than L tokens is cached as several pieces of at most L tokens.

Pure Python, no model: the router applies it to every request it plans, and bench.quality.eval
and bench.cold_model apply the same function, so what is measured is what is served.

A long document bounds the cold path (its build is the last to finish however many workers
there are); the seams handle any boundary, so its pieces can be built in parallel as separate
entries. The rule is a function of the token ids and L alone, so the same text always cuts the
same way and its pieces are reused as cache entries. The pieces are as equal as the length
allows (n = ceil(len / L) pieces whose lengths differ by at most one token): a fixed-L cut would
leave a short tail piece with little context of its own and no parallelism to gain from it.

    cut_segment(ids, 256)                 # [ids] when len(ids) <= 256, else near-equal pieces
    pieces, origin = cut_segments(segments, 256)   # origin[j]: the segment piece j came from
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")

# Pieces of at most this many tokens by default (0: never cut). Chosen on bench/quality
# (docs/results.md, "Cutting long segments"): the quality cost of a cut at this length.
DEFAULT_CUT_TOKENS = 1024


def n_pieces(length: int, max_tokens: int) -> int:
    """How many pieces a segment of `length` tokens is cut into (1: kept whole)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (0: never cut); got {max_tokens}")
    if max_tokens == 0 or length <= max_tokens:
        return 1
    return -(-length // max_tokens)


def cut_segment(ids: Sequence[T], max_tokens: int) -> list[list[T]]:
    """`ids` as consecutive pieces of at most `max_tokens` tokens, lengths differing by at most
    one (the longer pieces first); [ids] when it fits or max_tokens is 0."""
    n = n_pieces(len(ids), max_tokens)
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for k in range(n):
        stop = start + size + (1 if k < extra else 0)
        out.append(list(ids[start:stop]))
        start = stop
    return out


def cut_segments(segments: Sequence[Sequence[T]], max_tokens: int,
                 keep_whole: bool = False) -> tuple[list[list[T]], list[int]]:
    """Every segment cut by cut_segment (none when keep_whole); also, per piece, the index of
    the segment it came from."""
    pieces: list[list[T]] = []
    origin: list[int] = []
    for i, seg in enumerate(segments):
        parts = [list(seg)] if keep_whole else cut_segment(seg, max_tokens)
        pieces.extend(parts)
        origin.extend([i] * len(parts))
    return pieces, origin
