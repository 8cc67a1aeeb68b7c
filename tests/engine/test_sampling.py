"""top-p (nucleus) filtering: the vectorised filter equals the plain reference on random logits,
and sampling through pick_token never leaves the nucleus."""

from __future__ import annotations

import pytest
import torch

from common.engine.hybrid_engine import pick_token
from common.engine.sampling import top_p_filter, top_p_filter_reference


@pytest.mark.parametrize("vocab", [2, 17, 349, 1000])
def test_top_p_filter_matches_reference(vocab: int, fresh_seed: int) -> None:
    g = torch.Generator().manual_seed(fresh_seed)
    for _ in range(20):
        logits = torch.randn(vocab, generator=g) * float(torch.rand(1, generator=g) * 6 + 0.1)
        top_p = float(torch.rand(1, generator=g).clamp(0.01, 0.99))
        fast = top_p_filter(logits, top_p)
        ref = top_p_filter_reference(logits, top_p)
        assert torch.equal(torch.isinf(fast), torch.isinf(ref)), (vocab, top_p)
        kept = ~torch.isinf(fast)
        assert torch.equal(fast[kept], logits[kept])
        assert kept.any()
        # the nucleus holds at least top_p of the mass, and is minimal
        probs = torch.softmax(logits.double(), -1)
        assert probs[kept].sum() >= top_p - 1e-6
        assert probs[kept].sum() - probs[kept].min() < top_p + 1e-6


def test_top_p_off_values_keep_everything(fresh_seed: int) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(fresh_seed))
    for p in (0.0, 1.0, 1.5):
        assert torch.equal(top_p_filter(logits, p), logits)


def test_pick_token_samples_only_inside_the_nucleus(fresh_seed: int) -> None:
    g = torch.Generator().manual_seed(fresh_seed)
    logits = torch.randn(64, generator=g) * 3
    nucleus = set(torch.nonzero(~torch.isinf(top_p_filter_reference(logits, 0.5))).flatten().tolist())
    picks = {pick_token(logits, 1.0, gen=g, top_p=0.5) for _ in range(300)}
    assert picks <= nucleus
    everything = {pick_token(logits, 1.0, gen=g) for _ in range(300)}
    assert not everything <= nucleus  # without top_p, tokens outside it are drawn too
