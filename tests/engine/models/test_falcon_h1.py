"""Falcon-H1 (Mamba2 and attention in parallel in every layer, muP multipliers) against
transformers' own model on tiny random checkpoints. Each Falcon-H1 layer is two of ours
(attention part, Mamba2 part + MLP; common/engine/models/falcon_h1.py)."""
from __future__ import annotations

import pytest
import torch

from tests.support.hf_parity import PARITY_CHECKS, check_bf16, check_loading_error, reference_case
from tests.support.tiny import PIC_CONFIGS, save_tiny

CONFIGS = {
    "falcon_h1": PIC_CONFIGS["falcon_h1"],  # gated norm after the gate, every multiplier != 1
    # no Mamba norm (y * silu(z)), one group, biases on attention, MLP and out projections, tied head
    "falcon_h1_plain": dict(PIC_CONFIGS["falcon_h1"], mamba_rms_norm=False, mamba_n_groups=1,
                            attention_bias=True, mlp_bias=True, projectors_bias=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = save_tiny("falcon_h1", tmp_path_factory.mktemp(name), seed=0, **CONFIGS[name])
    case = reference_case(name, path, 512)
    return case


def test_structure_and_reference_scale(case):
    assert case["eng"].model.layer_kinds == ["attention", "linear"] * 2
    assert case["ref"].std() > 0.1


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy", "state"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    eng16 = check_bf16(case, moe_positions=True)
    m = eng16.model.layers[1].mixer
    assert m.A_log.dtype == torch.float32 and m.in_proj.weight.dtype == torch.bfloat16


def test_multipliers_matter(case):
    """Every muP multiplier is used: setting one back to 1 moves the logits (the test can fail)."""
    eng, ids = case["eng"], case["ids"][:40]
    base = eng.prefill(ids).logits
    m = eng.model
    for obj, attr in [(m, "embedding_multiplier"), (m.layers[0], "in_mult"), (m.layers[0], "out_mult"),
                      (m.layers[0].self_attn, "key_multiplier"), (m.layers[1], "out_mult"),
                      (m.layers[1].mamba.in_proj, "in_mult"), (m.layers[1].feed_forward, "down_mult")]:
        old = getattr(obj, attr)
        setattr(obj, attr, 1.0)
        try:
            assert (eng.prefill(ids).logits - base).abs().max() > 1e-3, attr
        finally:
            setattr(obj, attr, old)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.mamba.dt_bias", "drop"),
    ("model.layers.0.self_attn.k_proj.weight", "shape"),
    ("model.layers.1.feed_forward.gate_proj.weight", "drop"),
])
def test_bad_checkpoint_names_the_tensor(tensor, edit, tmp_path):
    check_loading_error(save_tiny("falcon_h1", tmp_path / "ok", seed=0, **CONFIGS["falcon_h1"]), tensor, edit, tmp_path)
