"""Granite 4 (granitemoehybrid: Mamba2 + attention, MoE + shared MLP, NoPE or RoPE) against
transformers' own model on tiny random checkpoints: prefill, chunked prefill, greedy decode, bf16."""
from __future__ import annotations

import pytest

from tests.support.hf_parity import PARITY_CHECKS, build_case, check_bf16, check_loading_error
from tests.support.tiny import save_tiny

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
    mamba_chunk_size=64, initializer_range=0.1,
    layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
    # Granite's muP scalars, away from 1 so that a missing one shows
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
)
CONFIGS = {
    # Granite-4.0-H: NoPE attention, MoE beside the shared MLP
    "granite_nope_moe": dict(BASE, num_local_experts=4, num_experts_per_tok=2),
    # RoPE attention, dense (no experts: the shared MLP alone)
    "granite_rope_dense": dict(BASE, num_local_experts=0, position_embedding_type="rope", mamba_n_groups=1),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    return build_case(name, "granitemoehybrid", CONFIGS[name], tmp_path_factory.mktemp(name))


def test_structure(case):
    assert case["eng"].model.layer_kinds == ["linear", "attention", "linear", "linear"]
    rotary = case["eng"].model.layers[1].mixer.rotary
    assert (rotary is None) == (case["name"] == "granite_nope_moe")


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    check_bf16(case)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("granitemoehybrid", tmp_path_factory.mktemp("granite_ckpt"), seed=2, **CONFIGS["granite_nope_moe"])


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.0.mamba.dt_bias", "drop"),
    ("model.layers.2.block_sparse_moe.input_linear.weight", "shrink"),
    ("model.layers.1.shared_mlp.output_linear.weight", "drop"),
])
def test_loading_errors_name_the_tensor(checkpoint, tensor, edit, tmp_path):
    check_loading_error(checkpoint, tensor, edit, tmp_path)
