"""Falcon-H1 (Mamba2 and attention in parallel in every layer, muP multipliers) against
transformers' own model on tiny random checkpoints. Each Falcon-H1 layer is two of ours
(attention part, Mamba2 part + MLP; common/models/falcon_h1.py)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hf_parity import (  # noqa: E402
    TOL, check_bf16, check_chunked, check_greedy, check_prefill, check_state_not_mutated, reference_case,
)
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny import PIC_CONFIGS, save_tiny  # noqa: E402

from common.engine import HybridEngine  # noqa: E402
from common.loader import CheckpointError  # noqa: E402

CONFIGS = {
    "falcon_h1": PIC_CONFIGS["falcon_h1"],  # gated norm after the gate, every multiplier != 1
    # no Mamba norm (y * silu(z)), one group, biases on attention, MLP and out projections, tied head
    "falcon_h1_plain": dict(PIC_CONFIGS["falcon_h1"], mamba_rms_norm=False, mamba_n_groups=1,
                            attention_bias=True, mlp_bias=True, projectors_bias=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = save_tiny("falcon_h1", tmp_path_factory.mktemp(name), seed=0, **CONFIGS[name])
    case = reference_case(name, path, 512)
    return case


def test_structure_and_reference_scale(case):
    assert case["eng"].model.layer_kinds == ["attention", "linear"] * 2
    assert case["ref"].std() > 0.1


def test_prefill_logits(case):
    diff = check_prefill(case)
    print(f"[{case['name']}] prefill max abs diff {diff:.3g}")
    assert diff < TOL


def test_chunked_prefill(case):
    diff = check_chunked(case)
    print(f"[{case['name']}] chunked prefill max abs diff {diff:.3g}")
    assert diff < TOL


def test_greedy_decode(case):
    tokens, worst = check_greedy(case)
    print(f"[{case['name']}] greedy decode max abs diff {worst:.3g}")
    assert tokens == case["ref_tokens"] and worst < TOL


def test_state_is_not_mutated(case):
    check_state_not_mutated(case)


def test_bf16(case):
    eng16 = check_bf16(case, moe_positions=True)
    m = eng16.model.layers[1].mixer
    assert m.A_log.dtype == torch.float32 and m.in_proj.weight.dtype == torch.bfloat16


def test_multipliers_matter(case):
    """Every muP multiplier is used: setting one back to 1 moves the logits (the test can fail)."""
    eng, ids = case["eng"], case["ids"][:40]
    base = eng.prefill(ids).logits
    m = eng.model
    for obj, attr in [(m, "embedding_multiplier"), (m.layers[0], "in_mult"), (m.layers[0], "out_mult"),
                      (m.layers[0].self_attn, "key_multiplier"), (m.layers[1], "out_mult"),
                      (m.layers[1].mamba.in_proj, "in_mult"), (m.layers[1].feed_forward, "down_mult")]:
        old = getattr(obj, attr)
        setattr(obj, attr, 1.0)
        try:
            assert (eng.prefill(ids).logits - base).abs().max() > 1e-3, attr
        finally:
            setattr(obj, attr, old)


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.mamba.dt_bias", "drop"),
    ("model.layers.0.self_attn.k_proj.weight", "shape"),
    ("model.layers.1.feed_forward.gate_proj.weight", "drop"),
])
def test_bad_checkpoint_names_the_tensor(tensor, edit, tmp_path):
    src = save_tiny("falcon_h1", tmp_path / "ok", seed=0, **CONFIGS["falcon_h1"])
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    if edit == "drop":
        sd.pop(tensor)
    else:
        sd[tensor] = sd[tensor][:-1].clone()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        HybridEngine.from_pretrained(dst)
