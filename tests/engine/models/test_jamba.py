"""Jamba (Mamba v1 + attention, MoE) against transformers' own model on tiny random checkpoints.

transformers' torch Mamba v1 path ignores the cached SSM state when a later prefill chunk has more
than one token (its selective scan starts from zeros), so its chunked prefill is wrong; ours is
held to transformers' full prefill instead (hf_parity.reference_case, hf_continues_prefill=False).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.hf_parity import PARITY_CHECKS, check_bf16, check_loading_error, reference_case
from tests.support.tiny import PIC_CONFIGS, save_tiny

CONFIGS = {
    "jamba": PIC_CONFIGS["jamba"],  # MoE on odd layers, attention at layer 2
    # dense MLPs, another state size and dt rank, attention first, a tied head
    "jamba_dense": dict(PIC_CONFIGS["jamba"], num_experts=1, mamba_d_state=4, mamba_dt_rank=8,
                        tie_word_embeddings=True, attn_layer_offset=0),
}
KINDS = {
    "jamba": ["linear", "linear", "attention", "linear"],
    "jamba_dense": ["attention", "linear", "linear", "linear"],
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = save_tiny("jamba", tmp_path_factory.mktemp(name), seed=0, **CONFIGS[name])
    case = reference_case(name, path, 512, hf_continues_prefill=False)
    return case


def test_structure_and_reference_scale(case):
    assert case["eng"].model.layer_kinds == KINDS[case["name"]]
    assert case["ref"].std() > 0.1


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy", "state"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    eng16 = check_bf16(case, moe_positions=True)
    m = next(layer.mixer for layer in eng16.model.layers if layer.kind == "linear")
    assert m.A_log.dtype == torch.float32 and m.in_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.mamba.A_log", "drop"),
    ("model.layers.3.feed_forward.experts.2.up_proj.weight", "drop"),
    ("model.layers.0.mamba.x_proj.weight", "shape"),
])
def test_bad_checkpoint_names_the_tensor(tensor, edit, tmp_path):
    check_loading_error(save_tiny("jamba", tmp_path / "ok", seed=0, **CONFIGS["jamba"]), tensor, edit, tmp_path)
