"""OLMo hybrid (Gated DeltaNet with beta in (0, 2) + OLMo-3 post-norm attention) against
transformers' own model on tiny random checkpoints: prefill, chunked prefill, greedy decode, bf16."""
from __future__ import annotations

import pytest
import torch

from hf_parity import build_case, check_bf16, check_chunked, check_greedy, check_prefill

# key_dim == value_dim (2 x 32 == 4 x 16): transformers' save_pretrained splits its fused short conv
# into three *equal* tensors, which is the checkpoint layout (q|k|v) only when the dims agree.
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=16, initializer_range=0.1, pad_token_id=0, eos_token_id=1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
CONFIGS = {
    "olmo_hybrid_rope": BASE,
    # the released checkpoints: NoPE attention
    "olmo_hybrid_nope": dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": None}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    return build_case(name, "olmo_hybrid", CONFIGS[name], tmp_path_factory.mktemp(name))


@torch.inference_mode()
def test_structure_and_negative_eigenvalues(case):
    model = case["eng"].model
    assert model.layer_kinds == ["linear", "attention", "linear", "linear"]
    assert (model.layers[1].mixer.rotary is None) == case["name"].endswith("nope")
    mixer = model.layers[0].mixer
    x = torch.randn(1, 64, mixer.hidden, generator=torch.Generator().manual_seed(5))
    beta = mixer.features(x, None)[4]
    assert 0 < beta.min() and beta.max() < 2 and (beta > 1).any()  # 1 - beta < 0 occurs


def test_prefill_logits(case):
    check_prefill(case)


def test_chunked_prefill(case):
    check_chunked(case)


def test_greedy_decode(case):
    check_greedy(case)


def test_bf16(case):
    check_bf16(case)
