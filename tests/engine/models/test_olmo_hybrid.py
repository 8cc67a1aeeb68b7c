"""OLMo hybrid (Gated DeltaNet with beta in (0, 2) + OLMo-3 post-norm attention) against
transformers' own model on tiny random checkpoints: prefill, chunked prefill, greedy decode, bf16."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from common.engine.hybrid_engine import HybridEngine

from tests.support.hf_parity import PARITY_CHECKS, build_case, check_bf16, check_loading_error, resave
from tests.support.tiny import save_tiny

# key_dim 32 != value_dim 64: transformers' save_pretrained writes its fused short conv as three equal
# thirds (43, 43, 42 channels), not the original q|k|v layout; both layouts must load.
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
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


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    check_bf16(case)


def _original_conv_layout(sd):
    """transformers' equal thirds -> the original q [key_dim] | k [key_dim] | v [value_dim] tensors."""
    for name in [k for k in sd if k.endswith("linear_attn.q_conv1d.weight")]:
        stem = name[: -len("q_conv1d.weight")]
        fused = torch.cat([sd.pop(f"{stem}{p}_conv1d.weight") for p in "qkv"], 0)
        for p, part in zip("qkv", torch.split(fused, [32, 32, 64], 0)):
            sd[f"{stem}{p}_conv1d.weight"] = part.clone()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("olmo_hybrid", tmp_path_factory.mktemp("olmo_ckpt"), seed=2, **BASE)


def test_saved_conv_layout_is_thirds_and_original_layout_loads(checkpoint, tmp_path):
    sd = load_file(str(checkpoint / "model.safetensors"))
    assert sd["model.layers.0.linear_attn.v_conv1d.weight"].shape[0] == 42  # the thirds, as saved
    path = resave(checkpoint, tmp_path / "orig", _original_conv_layout)
    assert load_file(str(path / "model.safetensors"))["model.layers.0.linear_attn.v_conv1d.weight"].shape[0] == 64
    ids = list(range(3, 53))
    logits = HybridEngine.from_pretrained(path).prefill(ids).logits
    assert torch.equal(logits, HybridEngine.from_pretrained(checkpoint).prefill(ids).logits)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.2.linear_attn.k_conv1d.weight", "drop"),
    ("model.layers.2.linear_attn.k_conv1d.weight", "shrink"),
    ("model.layers.1.feedforward_layer_norm.weight", "drop"),
    ("model.layers.1.self_attn.q_norm.weight", "shrink"),
])
def test_loading_errors_name_the_tensor(checkpoint, tensor, edit, tmp_path):
    check_loading_error(checkpoint, tensor, edit, tmp_path)
