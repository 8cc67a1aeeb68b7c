"""MiniMax (lightning attention: fixed per-head decay, + softmax attention, MoE) against
transformers' own model on tiny random checkpoints; and the lightning layer's composition.

The lightning layer has no short conv and no rotation: a segment's (T, S) composes exactly with
T = exp(-s_h n) per head, checked here on the real mixer (layer-level, fp32)."""
from __future__ import annotations

import pytest
import torch

from common.engine.pic.apply import run_warmup
from common.engine.pic.reference import linear_body_reference
from tests.support.hf_parity import PARITY_CHECKS, build_case, check_bf16, check_loading_error
from tests.support.tiny import save_tiny
from kernels.linear_attn import compose, linear_attention, naive_retnet

CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
    block_size=16,  # transformers' block-wise prefill then crosses many (and partial) blocks
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    # the residual scalars away from 1 so that a misplaced one shows
    linear_attn_alpha_factor=0.8, linear_attn_beta_factor=1.3, full_attn_alpha_factor=1.1,
    full_attn_beta_factor=0.7, mlp_alpha_factor=0.9, mlp_beta_factor=1.2,
)


def minimax_cache(model):
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    # transformers 5.23's MiniMax is wrong when a multi-token call continues its cache (measured: up to
    # 1.4 in logits against its own full prefill; its single-token decode agrees with full recompute
    # to 2e-6), so the chunked bar is held against its full prefill.
    return build_case("minimax", "minimax", CONFIG, tmp_path_factory.mktemp("minimax"), new_cache=minimax_cache,
                      hf_continues_prefill=False)


def test_structure(case):
    model = case["eng"].model
    assert model.layer_kinds == ["linear", "attention", "linear", "linear"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(case["path"]), dtype=torch.float32)
    for i in (0, 2, 3):  # our decays are transformers' slopes (which the checkpoint also stores)
        ref = hf.model.layers[i].self_attn.slope_rate.flatten()
        assert torch.allclose(-model.layers[i].mixer.log_decay, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("check", ["prefill", "chunked", "greedy"])
def test_parity(case, check):
    PARITY_CHECKS[check](case)


def test_bf16(case):
    check_bf16(case)


@torch.inference_mode()
def test_lightning_matches_naive_retnet(case, fresh_seed):
    """Our mixer's recurrence == the per-token RetNet reference on its own features."""
    mixer = case["eng"].model.layers[0].mixer
    x = torch.randn(1, 70, mixer.hidden, generator=torch.Generator().manual_seed(fresh_seed))
    q, k, v, g, _, _, _ = mixer.features(x)
    o, S = linear_attention(mixer.family, q, k, v, g=g, scale=mixer.scale)
    o_ref, S_ref = naive_retnet(q, k, v, g=mixer.log_decay, scale=1.0)
    assert (o - o_ref).abs().max() < 1e-5 * o_ref.abs().max()
    assert (S - S_ref).abs().max() < 1e-5 * S_ref.abs().max()


@pytest.mark.parametrize("lengths", [(37, 50), (3, 64, 1, 29), (120, 2, 2, 90, 17)])
@torch.inference_mode()
def test_lightning_composition(case, lengths, fresh_seed):
    """Segments summarised alone and composed == one run over the concatenation (no conv, no
    rotation: nothing to patch); adding states without T is measurably wrong."""
    mixer = case["eng"].model.layers[0].mixer
    g = torch.Generator().manual_seed(fresh_seed)
    xs = [torch.randn(1, n, mixer.hidden, generator=g) for n in lengths]
    q, k, v, gate, _, _, _ = mixer.features(torch.cat(xs, 1))
    _, S_full = linear_attention(mixer.family, q, k, v, g=gate, scale=mixer.scale)
    S, S_naive = None, None
    for x in xs:
        body = linear_body_reference(mixer, x, x.shape[1], w=0)
        assert body.form == "scalar" and body.conv_tail is None and body.warmup_inputs is None
        S = compose(body.summary, run_warmup(mixer, body, torch.zeros_like(body.S) if S is None else S, None))
        S_naive = body.S if S_naive is None else S_naive + body.S
    rel = float((S - S_full).norm() / S_full.norm())
    assert rel < 1e-5
    assert float((S_naive - S_full).norm() / S_full.norm()) > 100 * max(rel, 1e-7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("minimax", tmp_path_factory.mktemp("minimax_ckpt"), seed=2, **CONFIG)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.0.self_attn.qkv_proj.weight", "shrink"),
    ("model.layers.2.self_attn.output_gate.weight", "drop"),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "drop"),
])
def test_loading_errors_name_the_tensor(checkpoint, tensor, edit, tmp_path):
    check_loading_error(checkpoint, tensor, edit, tmp_path)
