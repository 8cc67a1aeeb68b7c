"""Nucleus (top-p) filtering of next-token logits, with the plain reference it is tested against.

top_p_filter keeps the smallest set of most probable tokens whose probability mass reaches
top_p (the token that crosses the threshold included, as in transformers' TopPLogitsWarper and
vLLM) and sets every other logit to -inf. top_p <= 0 or >= 1 means no filtering.
"""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [vocab] with the tokens outside the top-p nucleus at -inf (vectorised)."""
    if not 0.0 < top_p < 1.0:
        return logits
    probs = torch.softmax(logits.float(), -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    # Mass strictly before each token: a token stays while the mass before it is < top_p.
    before = torch.cumsum(sorted_probs, -1) - sorted_probs
    drop_sorted = before >= top_p
    drop_sorted[0] = False  # the most probable token always stays
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_p_filter_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The same, one token at a time in plain Python (the reference for tests)."""
    if not 0.0 < top_p < 1.0:
        return logits
    probs = torch.softmax(logits.double(), -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in ranked:
        keep.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    out = logits.clone()
    for i in range(len(probs)):
        if i not in keep:
            out[i] = float("-inf")
    return out
