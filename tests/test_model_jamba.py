"""Jamba (Mamba v1 + attention, MoE) against transformers' own model on tiny random checkpoints.

transformers' torch Mamba v1 path ignores the cached SSM state when a later prefill chunk has more
than one token (its selective scan starts from zeros), so its chunked prefill is wrong; ours is
held to transformers' full prefill instead (hf_parity.reference_case, hf_continues_prefill=False).
"""
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
    "jamba": PIC_CONFIGS["jamba"],  # MoE on odd layers, attention at layer 2
    # dense MLPs, another state size and dt rank, attention first, a tied head
    "jamba_dense": dict(PIC_CONFIGS["jamba"], num_experts=1, mamba_d_state=4, mamba_dt_rank=8,
                        tie_word_embeddings=True, attn_layer_offset=0),
}
KINDS = {
    "jamba": ["linear", "linear", "attention", "linear"],
    "jamba_dense": ["attention", "linear", "linear", "linear"],
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = save_tiny("jamba", tmp_path_factory.mktemp(name), seed=0, **CONFIGS[name])
    case = reference_case(name, path, 512, hf_continues_prefill=False)
    return case


def test_structure_and_reference_scale(case):
    assert case["eng"].model.layer_kinds == KINDS[case["name"]]
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
    m = next(layer.mixer for layer in eng16.model.layers if layer.kind == "linear")
    assert m.A_log.dtype == torch.float32 and m.in_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("tensor, edit", [
    ("model.layers.1.mamba.A_log", "drop"),
    ("model.layers.3.feed_forward.experts.2.up_proj.weight", "drop"),
    ("model.layers.0.mamba.x_proj.weight", "shape"),
])
def test_bad_checkpoint_names_the_tensor(tensor, edit, tmp_path):
    src = save_tiny("jamba", tmp_path / "ok", seed=0, **CONFIGS["jamba"])
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
