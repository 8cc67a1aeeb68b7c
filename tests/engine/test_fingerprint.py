"""segment_key, the content address of a cached entry (common.engine.fingerprint): every input
enters it, and its values are pinned, since a change would orphan every entry already in LMDB."""

from __future__ import annotations

import torch

from common.engine.fingerprint import segment_key


def test_segment_key_is_stable_and_covers_every_field() -> None:
    """Keys are content addresses kept in LMDB across versions: a change of the function would
    orphan every cached entry, so its value is pinned (it moves only with the key space's version,
    on purpose, when what an entry holds changes); and each input must change the key."""
    fp, ids = "f" * 64, [3, 1, 4, 1, 5, 9, 2, 6]
    key = segment_key(fp, 8, "float32", ids)
    assert key == "4a20ec398ddc2179c3c294f98e18044c43a3342e"  # v2 (hypic-seg-v2: MLA latents)
    variants = [segment_key("e" + fp[1:], 8, "float32", ids), segment_key(fp, 0, "float32", ids),
                segment_key(fp, 8, "bfloat16", ids), segment_key(fp, 8, "float32", ids[:-1]),
                segment_key(fp, 8, "float32", ids[::-1]), segment_key(fp, 8, "float32", ids + [0])]
    assert len({key, *variants}) == 1 + len(variants)


def test_segment_key_separates_every_input_and_is_stable(fresh_seed) -> None:
    """A key names exactly one entry: fingerprint, seam, dtype and the token ids (their order and
    count) all enter it; and it is a stable content address (a cache written by one version is
    found by the next), pinned by a known answer."""
    g = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, 512, (12,), generator=g).tolist()
    base = ("fp-a", 8, "float32", ids)
    variants = [base, ("fp-b", 8, "float32", ids), ("fp-a", 0, "float32", ids),
                ("fp-a", 9, "float32", ids), ("fp-a", 8, "bfloat16", ids),
                ("fp-a", 8, "float32", ids[:-1]), ("fp-a", 8, "float32", ids[::-1]),
                ("fp-a", 8, "float32", ids[:-1] + [(ids[-1] + 1) % 512])]
    keys = [segment_key(*v) for v in variants]
    assert len(set(keys)) == len(keys), keys
    assert segment_key(*base) == keys[0]
    assert segment_key("fp-golden", 8, "float32", [1, 2, 3, 500]) == "9732e68c511c8fb7aa5f5535bbfb464162734442"
