"""Zamba2 (Mamba2 + transformer blocks shared across depths with per-depth LoRA adapters) against
transformers' own model on tiny random checkpoints. A hybrid layer is two of ours (the shared
block at its slot, then the Mamba2 layer; common/engine/models/zamba2.py)."""
from __future__ import annotations

import pytest
import torch

from tests.support.hf_parity import PARITY_CHECKS, check_bf16, check_loading_error, reference_case
from tests.support.tiny import PIC_CONFIGS, save_tiny

CONFIGS = {
    "zamba2": PIC_CONFIGS["zamba2"],  # 2 shared blocks over 3 hybrid layers, adapters, RoPE
    # one shared block for every hybrid layer, no attention adapters (the MLP ones stay), no RoPE.
    # (Not an untied head: with tie_word_embeddings=False the pinned transformers also skips tying
    # the shared blocks, so its later hybrid layers run on freshly initialised weights.)
    "zamba2_plain": dict(PIC_CONFIGS["zamba2"], num_mem_blocks=1, use_shared_attention_adapter=False,
                         use_mem_rope=False),
}
KINDS = ["linear", "attention", "linear", "attention", "linear", "linear", "attention", "linear"]


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = save_tiny("zamba2", tmp_path_factory.mktemp(name), seed=0, **CONFIGS[name])
    case = reference_case(name, path, 512)
    return case


def test_structure_and_shared_weights(case):
    m = case["eng"].model
    assert m.layer_kinds == KINDS
    assert case["ref"].std() > 0.1
    blocks = [layer.shared_transformer for layer in m.layers if layer.kind == "attention"]
    n_mem = CONFIGS[case["name"]]["num_mem_blocks"]
    # hybrid layer k uses block k % num_mem_blocks: the same module (one set of weights)
    assert all(blocks[k] is blocks[k % n_mem] for k in range(len(blocks)))
    assert len({id(b) for b in blocks}) == n_mem


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy", "state"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    eng16 = check_bf16(case, moe_positions=True)
    m = eng16.model.layers[0].mixer
    assert m.A_log.dtype == torch.float32 and m.in_proj.weight.dtype == torch.bfloat16


def test_each_hybrid_layer_keeps_its_own_keys(case):
    """Shared weights, separate states: every hybrid layer caches keys of its own input."""
    out = case["eng"].prefill(case["ids"][:50])
    keys = [out.state.layers[j].keys for j, k in enumerate(KINDS) if k == "attention"]
    assert all(k.shape[2] == 50 for k in keys)
    assert (keys[0] - keys[2]).abs().max() > 1e-3  # same block (slot 0 and 2), other inputs


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.0.weight", "drop"),
    ("model.layers.2.shared_transformer.feed_forward.gate_up_proj.weight", "shape"),
    ("model.layers.4.mamba_decoder.mamba.A_log", "drop"),
    ("model.layers.3.mamba.in_proj.weight", "shape"),
])
def test_bad_checkpoint_names_the_tensor(tensor, edit, tmp_path):
    check_loading_error(save_tiny("zamba2", tmp_path / "ok", seed=0, **CONFIGS["zamba2"]), tensor, edit, tmp_path)
