"""Ring / Ling 2.5 (bailing_hybrid: KDA + gated MLA with interleaved RoPE, DeepSeek-style MoE)
against transformers' own model on tiny random checkpoints: prefill, chunked prefill, greedy
decode, bf16; and MLA key re-rotation."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.hf_parity import PARITY_CHECKS, build_case, check_bf16, check_loading_error
from tests.support.tiny import save_tiny

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, initializer_range=0.1, pad_token_id=0, eos_token_id=1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
CONFIGS = {
    "bailing_safe_gate": BASE,  # the released models: kda_safe_gate, grouped routing
    "bailing_softplus_gate": dict(BASE, kda_safe_gate=False, n_group=1, topk_group=1, n_shared_experts=2),
}


def _random_expert_bias(path):
    """Random init leaves the router's correction bias at 0: make it count."""
    f = path / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(3)
    for k in sd:
        if k.endswith("gate.expert_bias"):
            sd[k] = torch.rand(sd[k].shape, generator=g) * 0.5
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    return build_case(name, "bailing_hybrid", CONFIGS[name], tmp_path_factory.mktemp(name), edit=_random_expert_bias)


def test_structure(case):
    model = case["eng"].model
    assert model.layer_kinds == ["linear", "attention", "linear", "linear"]
    assert model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    # MoE routing flips under bf16 rounding: transformers' own bf16 model agrees with its fp32 top-1
    # on 0.90 of these positions (measured), ours on 0.86-0.87 and with transformers' bf16 on 0.93.
    check_bf16(case, min_agree=0.8)


@torch.inference_mode()
def test_mla_rerotation(case, fresh_seed):
    """Keys computed at positions p, re-rotated by d == keys computed at p + d."""
    mla = case["eng"].model.layers[1].mixer
    x = torch.randn(1, 9, mla.hidden, generator=torch.Generator().manual_seed(fresh_seed))
    d = 37 + fresh_seed % 1000
    _, k0, _ = mla.qkv(x, torch.arange(9))
    _, kd, _ = mla.qkv(x, torch.arange(d, d + 9))
    assert (mla.rerotate(k0, d) - kd).abs().max() < 1e-5
    assert (k0 - kd).abs().max() > 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("bailing_hybrid", tmp_path_factory.mktemp("bailing_hybrid_ckpt"), seed=2, **BASE)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.0.attention.f_proj.weight", "shrink"),
    ("model.layers.2.attention.v_conv1d.weight", "drop"),
    ("model.layers.1.mlp.gate.expert_bias", "drop"),
    ("model.layers.1.attention.kv_b_proj.weight", "shrink"),
    ("model.word_embeddings.weight", "drop"),
])
def test_loading_errors_name_the_tensor(checkpoint, tensor, edit, tmp_path):
    check_loading_error(checkpoint, tensor, edit, tmp_path)
