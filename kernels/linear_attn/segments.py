"""Prefill of consecutive segments with the state kept at every segment end, in one chunked pass.

The prefix-cache baseline keeps a model state at each segment boundary of the prompts it sees (as
vLLM's and SGLang's hybrid prefix caches keep states at block boundaries). Running the linear
layers one segment at a time (`segment_states_reference`) gives those states but pays the chunked
path's fixed cost once per segment: 1.4-1.8x the time of one pass over the same tokens on the
bundled model, which made the baseline slower than full recompute with nothing to reuse.

`segment_states` instead pads every segment to a whole number of chunks with tokens that leave
the state unchanged (k = 0, v = 0, beta = 0, log-decay 0: the recurrence adds nothing and decays
nothing), runs the chunked path once, and reads each segment's end state where the next chunk
starts, from the chunk states that pass computes anyway. The padding costs at most C - 1 tokens a
segment (C = 32 or 64). On the fla path (CUDA) it falls back to the reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .chunk import _chunk_core, default_chunk_size
from .families import check_inputs
from .fla_path import FLA_FAMILIES, use_fla


def segment_states_reference(family: str, q, k, v, *, g=None, beta=None, initial_state=None, scale=None,
                             ends: Sequence[int], backend: str = "auto"):
    """(o [B,T,H,V], [state after each segment [B,H,K,V] fp32]): one `linear_attention` call per
    segment, each from the state the previous one left. `ends` are the segments' end offsets,
    increasing, the last equal to T."""
    from . import linear_attention  # (the package's __init__ imports this module)

    _check_ends(ends, k.shape[1])
    per_token = g is not None and g.dim() >= 3
    outs, states, S, a = [], [], initial_state, 0
    for e in ends:
        sl = slice(a, e)
        o, S = linear_attention(family, q[:, sl], k[:, sl], v[:, sl], g=g[:, sl] if per_token else g,
                                beta=beta[:, sl] if beta is not None else None, initial_state=S, scale=scale,
                                backend=backend)
        outs.append(o)
        states.append(S)
        a = e
    return torch.cat(outs, 1), states


def segment_states(family: str, q, k, v, *, g=None, beta=None, initial_state=None, scale=None,
                   ends: Sequence[int], backend: str = "auto"):
    """Same contract as :func:`segment_states_reference`, in one chunked pass (module docstring)."""
    _check_ends(ends, k.shape[1])
    fla = family in FLA_FAMILIES and use_fla(backend, v)
    if fla or backend == "fla" or not ends or ends[-1] == 0:
        return segment_states_reference(family, q, k, v, g=g, beta=beta, initial_state=initial_state,
                                        scale=scale, ends=ends, backend=backend)
    row = check_inputs(family, g, beta)
    delta = row.delta
    if scale is None:
        scale = 1.0 if row.unit_scale else k.shape[-1] ** -0.5
    C = default_chunk_size(family, q.device)
    B, T = k.shape[:2]
    # every segment's real start, padded start, length and padded length
    pieces, a, b = [], 0, 0
    for e in ends:
        n = e - a
        pieces.append((a, b, n, -(-n // C) * C))
        a, b = e, b + pieces[-1][3]
    Tp = b

    def spread(x):  # [B, T, ...] -> [B, Tp, ...], zeros at the padding (slice copies: an index_put costs 3x)
        if x is None:
            return None
        out = x.new_empty((x.shape[0], Tp) + tuple(x.shape[2:]))
        for a, b, n, p in pieces:
            out[:, b:b + n] = x[:, a:a + n]
            out[:, b + n:b + p].zero_()
        return out

    if g is not None and g.dim() == 1:  # a fixed decay per head: per token, so that the padding decays nothing
        g = g.view(1, 1, -1).expand(B, T, -1)
    starts: list = []
    o, S, _ = _chunk_core(spread(q), spread(k), spread(v), spread(g), spread(beta), initial_state, scale, delta,
                          C, starts=starts)
    entering = starts[0]  # [N, B, H, K, V]: the state entering chunk n
    chunk_at_end = [(b + p) // C for _, b, _, p in pieces]
    states = [entering[n].clone() if n < entering.shape[0] else S for n in chunk_at_end]
    return torch.cat([o[:, b:b + n] for _, b, n, _ in pieces], 1), states


def _check_ends(ends: Sequence[int], T: int) -> None:
    if any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] != T) or (not ends and T):
        raise ValueError(f"segment ends {list(ends)} must increase from 0 and end at T={T}")
