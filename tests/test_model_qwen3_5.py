"""Our Qwen3.5 / Qwen3.5-MoE / Qwen3-Next against transformers' own models (fp32, CPU)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine import HybridEngine
from common.loader import CheckpointError
from common.models import UnsupportedArchitecture
from tiny import hf_chunked_and_greedy, hf_prefill_logits, load_hf, save_tiny

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
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(5)).tolist()

    ref = hf_prefill_logits(hf, ids)
    assert ref.std() > 0.1  # a model whose logits are all ~0 would make the comparison empty
    full = eng.prefill(ids, return_all_logits=True)
    assert (full.all_logits - ref).abs().max() < 1e-4

    ref_chunked, ref_tokens, ref_step_logits = hf_chunked_and_greedy(hf, ids, chunks=3, steps=20)
    chunked = eng.prefill(ids, chunk_size=100, return_all_logits=True)
    assert (chunked.all_logits - ref_chunked).abs().max() < 1e-4

    tokens = eng.generate(ids, max_new_tokens=20)
    assert tokens == ref_tokens
    logits, state = chunked.logits, chunked.state
    for tok, ref_logits in zip(ref_tokens, ref_step_logits):
        assert (logits - ref_logits).abs().max() < 1e-4
        logits, state = eng.decode_step(tok, state)


def test_bf16_close_to_fp32(checkpoint):
    _, path = checkpoint
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    f32 = HybridEngine.from_pretrained(path).prefill(ids, return_all_logits=True).all_logits
    b16 = HybridEngine.from_pretrained(path, dtype=torch.bfloat16).prefill(ids, return_all_logits=True).all_logits
    assert torch.isfinite(b16).all()
    agree = (f32.argmax(-1) == b16.argmax(-1)).float().mean()
    assert agree > 0.8, agree


def test_prefill_does_not_mutate_given_state(checkpoint):
    _, path = checkpoint
    eng = HybridEngine.from_pretrained(path)
    a = eng.prefill(list(range(40)))
    first = eng.prefill(list(range(40, 60)), state=a.state).logits
    again = eng.prefill(list(range(40, 60)), state=a.state).logits
    assert torch.equal(first, again)
    assert a.state.seq_len == 40


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
