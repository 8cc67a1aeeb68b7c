"""Our Kimi-Linear (KDA + MLA, MoE or dense MLPs) against transformers' own model (fp32, CPU)."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels.linear_attn as _la

if not hasattr(_la, "linear_attention"):
    # The kernels API is not there yet: stand in the reference recurrence (same contract).
    from kernels.linear_attn.naive import naive_recurrent

    def _linear_attention(family, q, k, v, *, g=None, beta=None, initial_state=None, scale=None):
        assert family == "kda", family
        return naive_recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state, scale=scale, delta=True)

    def _recurrent_step(family, q, k, v, *, g=None, beta=None, state=None, scale=None):
        return _linear_attention(family, q, k, v, g=g, beta=beta, initial_state=state, scale=scale)

    _la.linear_attention, _la.recurrent_step = _linear_attention, _recurrent_step

from common.engine.hybrid_engine import HybridEngine  # noqa: E402
from common.engine.loader import CheckpointError  # noqa: E402
from tests.support.hf_parity import check_matches_transformers, check_prefill_keeps_given_state  # noqa: E402
from tests.support.tiny import load_hf, save_tiny  # noqa: E402

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    linear_num_heads=4, linear_head_dim=16, initializer_range=0.1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,  # the defaults lie outside a 512-token vocabulary
)
CONFIGS = {
    # The architecture's default MLPs: layer 0 dense, the rest MoE (group-limited routing).
    "moe": {**BASE, "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "n_shared_experts": 1},
    # All dense, attention first, low-rank queries (q_a_proj / q_a_layernorm / q_b_proj).
    "dense": {**BASE, "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
              "mlp_layer_types": ["dense"] * 4, "q_lora_rank": 16},
}


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _perturb(tensors, seed=3):
    """transformers initialises norms to 1 and the router bias to 0: randomise them so that the
    comparison sees how they are applied."""
    g = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.2 * torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=g)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = save_tiny("kimi_linear", tmp_path_factory.mktemp(request.param), seed=11, **CONFIGS[request.param])
    _rewrite(path, _perturb)
    return request.param, path


def test_matches_transformers(checkpoint):
    name, path = checkpoint
    hf = load_hf(path)
    eng = HybridEngine.from_pretrained(path)
    assert eng.model_type == "kimi_linear"
    assert eng.model.layer_kinds == ["linear" if t == "linear_attention" else "attention"
                                     for t in CONFIGS[name]["layer_types"]]
    state = check_matches_transformers(hf, eng)
    # The MLA state holds what the model's own cache holds: the normed latent and k_rot, one shared
    # head [B, 1, T, kv_lora_rank + rope]; the values are the latent (zero-width value tensor).
    attn = state.layers[eng.model.layer_kinds.index("attention")]
    assert attn.keys.shape == (1, 1, 320, 32 + 8) and attn.values.shape == (1, 1, 320, 0)


def test_bf16_close_to_fp32(checkpoint):
    _, path = checkpoint
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    f32 = HybridEngine.from_pretrained(path).prefill(ids, return_all_logits=True).all_logits
    eng = HybridEngine.from_pretrained(path, dtype=torch.bfloat16)
    assert eng.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    b16 = eng.prefill(ids, return_all_logits=True).all_logits
    assert torch.isfinite(b16).all()
    agree = (f32.argmax(-1) == b16.argmax(-1)).float().mean()
    assert agree > 0.8, agree


def test_prefill_does_not_mutate_given_state(checkpoint):
    check_prefill_keeps_given_state(HybridEngine.from_pretrained(checkpoint[1]))


def test_original_checkpoint_layout(checkpoint, tmp_path):
    """Moonshot's checkpoints keep dense MLPs under `mlp.` (transformers' export writes every MLP
    under `block_sparse_moe.`): both load to the same model."""
    _, path = checkpoint
    ids = list(range(3, 60))
    ref = HybridEngine.from_pretrained(path).prefill(ids).logits
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    tensors = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    save_file(tensors, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    assert (HybridEngine.from_pretrained(renamed).prefill(ids).logits - ref).abs().max() < 1e-5


def test_missing_weight_is_named(tmp_path):
    path = save_tiny("kimi_linear", tmp_path, **CONFIGS["moe"])
    name = "model.layers.2.self_attn.f_b_proj.weight"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        HybridEngine.from_pretrained(path)
    assert "kimi_linear" in str(e.value)


def test_shape_mismatch_is_named(tmp_path):
    path = save_tiny("kimi_linear", tmp_path, **CONFIGS["moe"])
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(name, torch.zeros(7, 32)))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*\(7, 32\)"):
        HybridEngine.from_pretrained(path)
