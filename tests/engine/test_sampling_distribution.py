"""Sampling at temperature T draws from softmax(logits / T) (with top_k, restricted to the k most
probable tokens and renormalised): the empirical distribution of many
samples through pick_token (what combine's decode uses) matches it, within a tolerance that the
distribution at any other temperature tried here (1/T's, T's square's) cannot meet."""

from __future__ import annotations

import pytest
import torch

from common.engine.hybrid_engine import pick_token

SAMPLES = 6_000
# Total variation between the empirical and the true distribution of 6k draws over 6 tokens is
# at most about 0.013 (half the sum over tokens of E|p_hat - p|); 0.03 leaves room and still
# rejects a wrong T (the nearest wrong distribution below is 0.095 away).
TOLERANCE = 0.03


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def empirical(logits: torch.Tensor, temperature: float, seed: int, top_k: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    for _ in range(SAMPLES):
        counts[pick_token(logits, temperature, top_k, gen=gen)] += 1
    return counts / SAMPLES


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.5, 2.0])
def test_samples_follow_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = torch.randn(6, generator=torch.Generator().manual_seed(11))
    want = torch.softmax(logits.double() / temperature, -1)
    # The check can tell temperatures apart: the distributions a wrong temperature gives (the
    # logits multiplied by T, or divided by T twice) are far outside the tolerance.
    for wrong in (torch.softmax(logits.double() * temperature, -1),
                  torch.softmax(logits.double() / temperature**2, -1)):
        assert total_variation(wrong, want) > 3 * TOLERANCE
    got = empirical(logits, temperature, seed=1234)
    assert total_variation(got, want) < TOLERANCE, (got, want)


@pytest.mark.parametrize("top_k", [2, 3])
def test_top_k_samples_the_k_most_probable_in_proportion(top_k: int) -> None:
    logits = torch.randn(6, generator=torch.Generator().manual_seed(11))
    temperature = 1.5  # flat enough that every token outside the top k carries real mass
    top = torch.topk(logits, top_k).indices
    want = torch.zeros(6, dtype=torch.float64)
    want[top] = torch.softmax(logits.double()[top] / temperature, -1)
    # A top-k one token short, or none at all, is far outside the tolerance.
    short = torch.zeros(6, dtype=torch.float64)
    short[top[:-1]] = torch.softmax(logits.double()[top[:-1]] / temperature, -1)
    for wrong in (short, torch.softmax(logits.double() / temperature, -1)):
        assert total_variation(wrong, want) > 3 * TOLERANCE
    got = empirical(logits, temperature, seed=99, top_k=top_k)
    assert total_variation(got, want) < TOLERANCE, (got, want)


def test_temperature_zero_is_greedy() -> None:
    logits = torch.randn(32, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(0)
    assert {pick_token(logits, 0.0, gen=gen) for _ in range(50)} == {int(torch.argmax(logits))}
