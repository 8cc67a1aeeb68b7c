"""The cut rule (common/engine/cut.py) against a plain reference on random lengths: the pieces
rebuild the segment, none is longer than L, there are as few as L allows, their lengths differ
by at most one, and the same ids always cut the same way."""
from __future__ import annotations

import random

import pytest

from common.engine.cut import cut_segment, cut_segments, n_pieces


def reference_cut(ids: list[int], max_tokens: int) -> list[list[int]]:
    """One token at a time into the piece whose turn it is: n pieces, the first len % n of them
    one token longer."""
    if max_tokens == 0 or len(ids) <= max_tokens:
        return [list(ids)]
    n = (len(ids) + max_tokens - 1) // max_tokens
    sizes = [len(ids) // n + (1 if k < len(ids) % n else 0) for k in range(n)]
    out, pos = [], 0
    for size in sizes:
        out.append([ids[pos + j] for j in range(size)])
        pos += size
    return out


def test_cut_matches_the_reference_on_random_lengths(fresh_seed) -> None:
    g = random.Random(fresh_seed)
    for _ in range(500):
        L = g.choice([0, 1, 2, 7, 64, 128, 256, 512])
        ids = [g.randrange(1000) for _ in range(g.randrange(1, 3000))]
        pieces = cut_segment(ids, L)
        assert pieces == reference_cut(ids, L)
        assert [t for p in pieces for t in p] == ids
        assert len(pieces) == n_pieces(len(ids), L)
        if L:
            assert max(map(len, pieces)) <= L
            assert len(pieces) == 1 or (len(pieces) - 1) * L < len(ids)   # as few as L allows
        assert max(map(len, pieces)) - min(map(len, pieces)) <= 1
        assert cut_segment(list(ids), L) == pieces                       # the same text, the same cut


def test_cut_of_a_4084_token_document_at_256() -> None:
    pieces = cut_segment(list(range(4084)), 256)
    assert len(pieces) == 16 and {len(p) for p in pieces} == {255, 256}


def test_cut_segments_keeps_order_origin_and_keep_whole() -> None:
    segs = [list(range(10)), list(range(100, 103)), list(range(200, 225))]
    pieces, origin = cut_segments(segs, 8)
    assert [len(p) for p in pieces] == [5, 5, 3, 7, 6, 6, 6]
    assert origin == [0, 0, 1, 2, 2, 2, 2]
    assert [t for p in pieces for t in p] == [t for s in segs for t in s]
    assert cut_segments(segs, 8, keep_whole=True) == (segs, [0, 1, 2])
    assert cut_segments(segs, 0) == (segs, [0, 1, 2])


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError):
        cut_segment([1, 2, 3], -1)
