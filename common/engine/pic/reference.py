"""Plain definitions that only tests and benchmarks use, beside the fast paths they check
(the standards: every fast path has a plain reference and tests comparing them on random inputs).

`build_entry_reference` is common.engine.pic.build.build_entry written out step by step: a plain
forward with the linear mixers' inputs captured, then every linear layer's features, summary and
conv inputs computed again from them (`linear_body_reference`).
"""
from __future__ import annotations

import torch

from common.engine.pic.build import check_build, entry_from_state, sliced
from common.engine.pic.entry import LinearBody, SegmentEntry
from kernels.linear_attn import identity_transition, segment_summary, summary_form


@torch.inference_mode()
def build_entry_reference(engine, token_ids, seam: int) -> SegmentEntry:
    """The plain definition: a forward with the mixers' inputs captured, then every linear
    layer's features, summary and conv inputs computed again from them."""
    ids, seam = check_build(engine, token_ids, seam)
    model = engine.model
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if layer.kind == "linear":
            hooks.append(layer.mixer.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[0])))
    try:
        _, _, state = engine.forward(ids, engine.new_state())
    finally:
        for h in hooks:
            h.remove()
    L, w = len(ids), min(seam, len(ids))
    bodies = {i: linear_body_reference(model.layers[i].mixer, x, L, w) for i, x in captured.items()}
    return entry_from_state(engine, ids, seam, state, bodies)


def linear_body_reference(mixer, x: torch.Tensor, L: int, w: int) -> LinearBody:
    """A linear layer's cached body from its mixer's inputs x [1, L, D] over a segment of L tokens
    with a seam of w: features, summary (kernels.linear_attn.segment_summary) and conv inputs
    computed again, one by one."""
    c = mixer.conv_kernel
    warm_end = min(L, max(w, c - 1))
    q, k, v, g, beta, _aux, _ = mixer.features(x, None)
    H, K = k.shape[2], k.shape[3]
    if warm_end < L:
        sl = slice(warm_end, L)
        summ = segment_summary(mixer.family, k[:, sl], v[:, sl], g=sliced(g, sl), beta=sliced(beta, sl))
        T, form, S = summ.T, summ.form, summ.S
    else:
        form = summary_form(mixer.family)
        T = identity_transition(form, 1, H, K, k.device)
        S = torch.zeros(1, H, K, v.shape[-1], device=k.device)
    u = mixer.conv_inputs(x)  # [1, L, C]
    conv_tail = u[:, max(w, L - (c - 1)) :].transpose(1, 2).contiguous() if L > w and c > 1 else None
    warm = x[:, w:warm_end].contiguous() if warm_end > w else None
    return LinearBody(T=T.contiguous(), form=form, S=S.contiguous(), conv_tail=conv_tail, warmup_inputs=warm)
