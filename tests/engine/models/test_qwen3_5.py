"""Our Qwen3.5 / Qwen3.5-MoE / Qwen3-Next against transformers' own models (fp32, CPU)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.hybrid_engine import HybridEngine
from common.engine.loader import CheckpointError
from common.engine.models import UnsupportedArchitecture
from tests.support.hf_parity import check_matches_transformers, check_prefill_keeps_given_state
from tests.support.tiny import load_hf, save_tiny

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.1,
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_5_text": BASE,
    "qwen3_5_moe_text": {**BASE, **MOE},
    "qwen3_next": {**BASE, **MOE},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    mt = request.param
    return mt, save_tiny(mt, tmp_path_factory.mktemp(mt), seed=11, **CONFIGS[mt])


def test_matches_transformers(checkpoint):
    mt, path = checkpoint
    hf = load_hf(path)
    eng = HybridEngine.from_pretrained(path)
    assert eng.model_type == mt
    check_matches_transformers(hf, eng)


def test_bf16_close_to_fp32(checkpoint):
    _, path = checkpoint
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    f32 = HybridEngine.from_pretrained(path).prefill(ids, return_all_logits=True).all_logits
    b16 = HybridEngine.from_pretrained(path, dtype=torch.bfloat16).prefill(ids, return_all_logits=True).all_logits
    assert torch.isfinite(b16).all()
    agree = (f32.argmax(-1) == b16.argmax(-1)).float().mean()
    assert agree > 0.8, agree


def test_prefill_does_not_mutate_given_state(checkpoint):
    check_prefill_keeps_given_state(HybridEngine.from_pretrained(checkpoint[1]))


def test_bad_tokens_and_empty(checkpoint):
    _, path = checkpoint
    eng = HybridEngine.from_pretrained(path)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.prefill([1, 2, 512])
    with pytest.raises(ValueError, match="empty"):
        eng.prefill([])


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    path = save_tiny("qwen3_5_text", tmp_path, **BASE)
    name = "model.layers.1.linear_attn.in_proj_qkv.weight"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        HybridEngine.from_pretrained(path)
    assert "qwen3_5" in str(e.value)


def test_shape_mismatch_is_named(tmp_path):
    path = save_tiny("qwen3_5_text", tmp_path, **BASE)
    name = "model.layers.3.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(name, torch.zeros(7, 64)))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(7, 64\)"):
        HybridEngine.from_pretrained(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = save_tiny("qwen3_5_text", tmp_path, **BASE)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="llama"):
        HybridEngine.from_pretrained(path)
