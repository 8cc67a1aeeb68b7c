"""The drift figures (common/engine/drift.py) against plain references: KL from probabilities,
argmaxes compared one by one, and the full recompute of prompt + generated in one forward pass
with every position's logits (the fast path prefills, then runs only the generated tokens)."""
from __future__ import annotations

import math

import pytest
import torch

from common.engine.drift import measure_drift, query_divergence, step_agreement
from common.engine.hybrid_engine import HybridEngine
from tests.support.tiny import save_tiny


def reference_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    return sum(float(pi) * math.log(float(pi) / float(qi)) for pi, qi in zip(p, q) if pi > 0)


def test_kl_and_top1_match_the_reference_on_random_logits(fresh_seed) -> None:
    g = torch.Generator().manual_seed(fresh_seed)
    for vocab in (3, 17, 301):
        a, b = torch.randn(vocab, generator=g) * 3, torch.randn(vocab, generator=g) * 3
        kl, top1 = query_divergence(a, b)
        assert kl == pytest.approx(reference_kl(a, b), rel=1e-4, abs=1e-6)
        assert top1 == (int(a.argmax()) == int(b.argmax()))
        same, same_top1 = query_divergence(a, a.clone())
        assert same == pytest.approx(0.0, abs=1e-6) and same_top1
    with pytest.raises(ValueError):
        query_divergence(torch.zeros(4), torch.zeros(5))


def test_step_agreement_counts_matching_argmaxes(fresh_seed) -> None:
    g = torch.Generator().manual_seed(fresh_seed)
    logits = torch.randn(9, 11, generator=g)
    picks = [int(i) for i in logits.argmax(-1)]
    assert step_agreement(logits, picks) == 1.0
    wrong = [(p + 1) % 11 for p in picks[:4]] + picks[4:]
    assert step_agreement(logits, wrong) == pytest.approx(5 / 9)
    with pytest.raises(ValueError):
        step_agreement(logits, picks[:3])


def test_measure_drift_matches_one_full_forward(tmp_path, fresh_seed) -> None:
    path = save_tiny("qwen3_5_text", tmp_path / "m", seed=fresh_seed % 1000, vocab_size=97, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                     linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                     initializer_range=0.1)
    engine = HybridEngine.from_pretrained(path)
    g = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(0, 97, (23,), generator=g).tolist()
    generated = torch.randint(0, 97, (6,), generator=g).tolist()
    every = engine.prefill(prompt + generated[:-1], return_all_logits=True).all_logits[len(prompt) - 1:]
    hypic_logits = every[0] + 0.5 * torch.randn(97, generator=g)
    picks = [int(i) for i in every.argmax(-1)]
    picks[2] = (picks[2] + 1) % 97
    d = measure_drift(engine, prompt, generated, picks, hypic_logits)
    assert d.kl == pytest.approx(reference_kl(every[0], hypic_logits), rel=1e-3, abs=1e-6)
    assert d.top1_agree == (int(every[0].argmax()) == int(hypic_logits.argmax()))
    assert d.agreement == pytest.approx(5 / 6) and d.steps == 6
    exact = measure_drift(engine, prompt, generated, [int(i) for i in every.argmax(-1)], every[0])
    assert exact.kl == pytest.approx(0.0, abs=1e-5) and exact.top1_agree and exact.agreement == 1.0
