"""The combine's rule for an entry in another format than its own (services.combine.fetch.
in_expected_format), for every pair of formats: an fp32 entry is rounded to the combine's format,
to exactly the entry a builder of that format writes; a compact entry of another format is refused
(BadEntry "format": dropped and rebuilt), never widened or re-rounded."""
from __future__ import annotations

import itertools

import pytest
import torch

from common.engine.dtypes import ENTRY_FORMATS
from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry
from services.combine.fetch import BadEntry, in_expected_format


def random_entry(seed: int) -> SegmentEntry:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layers = [LinearBody(T=r(1, 2, 8, 8), form="matrix", S=r(1, 2, 8, 4), conv_tail=r(1, 6, 3), warmup_inputs=None),
              AttentionBody(r(1, 2, 5, 8), r(1, 2, 5, 8))]
    return SegmentEntry(list(range(9)), 4, "c" * 64, "float32", layers)


@pytest.mark.parametrize("stored,expected", list(itertools.product(ENTRY_FORMATS, repeat=2)))
def test_each_pair_of_formats(stored, expected, fresh_seed):
    e32 = random_entry(fresh_seed)
    entry = SegmentEntry.from_bytes(e32.with_format(stored).to_bytes())
    if stored == expected:
        assert in_expected_format(entry, expected) is entry
    elif stored == "fp32":
        got = in_expected_format(entry, expected)
        assert got.format == expected and got.to_bytes() == e32.with_format(expected).to_bytes()
    else:
        with pytest.raises(BadEntry, match=f"stored in {stored}") as err:
            in_expected_format(entry, expected)
        assert err.value.reason == "format"
