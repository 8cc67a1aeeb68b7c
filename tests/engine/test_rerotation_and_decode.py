"""Positions and decode, checked against an independent computation rather than against a second
path that shares the code under test (hand-made mutants of the re-rotation and of decode's state
update passed the comparison tests):

- re-rotation: a mixer's keys computed at positions p.. and re-rotated by d equal its keys
  computed directly at p+d.. (per model family: partial rotary, no rotary, MLA without rope);
  end to end, in a model whose first layer is full attention (its keys depend only on the
  embeddings and the positions), layer 0's keys after a hypic prefill of several segments equal
  those of a full prefill;
- decode: the logits after decoding t equal those of prefilling the prompt plus t, token after
  token (so a decode that drops a layer's state update shows at the next step).
"""

from __future__ import annotations

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from tests.support.tiny import PIC_CONFIGS, save_tiny

FAMILIES = sorted(PIC_CONFIGS)
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, HybridEngine]:
    base = tmp_path_factory.mktemp("guards")
    return {f: HybridEngine.from_pretrained(save_tiny(f, base / f, seed=11, **PIC_CONFIGS[f]),
                                            load_tokenizer=False) for f in FAMILIES}


def attention_mixers(engine: HybridEngine) -> list[torch.nn.Module]:
    mixers = [m for m in engine.model.modules() if hasattr(m, "rerotate") and hasattr(m, "qkv")]
    assert mixers, "no attention mixer found"
    return mixers


def keys_at(mixer: torch.nn.Module, x: torch.Tensor, start: int) -> torch.Tensor:
    """The mixer's keys for hidden states x [1, T, D] placed at positions start..start+T-1."""
    positions = torch.arange(start, start + x.shape[1])
    return mixer.qkv(x, positions)[1]


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_rerotated_keys_equal_keys_computed_at_the_new_positions(engines, family, fresh_seed) -> None:
    engine = engines[family]
    g = torch.Generator().manual_seed(fresh_seed)
    hidden = engine.model.embed_tokens.weight.shape[1]
    for mixer in attention_mixers(engine):
        x = torch.randn(1, 9, getattr(mixer, "input_size", hidden), generator=g)
        for p, d in ((0, 1), (0, 37), (5, 200), (13, 1)):
            direct = keys_at(mixer, x, p + d)
            moved = mixer.rerotate(keys_at(mixer, x, p), d)
            err = float((moved - direct).abs().max())
            assert err < TOL, (family, p, d, err)
        rotary = getattr(mixer, "rotary", None)
        if rotary is not None:  # and the keys do depend on the position: the check can fail
            assert float((keys_at(mixer, x, 0) - keys_at(mixer, x, 1)).abs().max()) > 1e-3


@pytest.fixture(scope="module")
def full_first(tmp_path_factory) -> HybridEngine:
    cfg = dict(PIC_CONFIGS["qwen3_5_text"],
               layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"])
    path = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("full-first"), seed=12, **cfg)
    return HybridEngine.from_pretrained(path, load_tokenizer=False)


@torch.inference_mode()
def test_layer0_keys_after_hypic_prefill_equal_a_full_prefill(full_first, fresh_seed) -> None:
    engine = full_first
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (17, 5, 30, 11)]
    query = torch.randint(0, 512, (4,), generator=g).tolist()
    for seam in (0, 4):
        hypic = engine.prefill_segments(segs, query, mode="hypic", seam=seam).state.layers[0].keys
        full = engine.prefill([t for s in segs for t in s] + query).state.layers[0].keys
        assert hypic.shape == full.shape
        err = float((hypic - full).abs().max())
        assert err < TOL, (seam, err)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_decode_logits_equal_prefill_of_the_longer_prompt(engines, family, fresh_seed) -> None:
    engine = engines[family]
    g = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(0, 512, (21,), generator=g).tolist()
    steps = torch.randint(0, 512, (4,), generator=g).tolist()
    state = engine.prefill(prompt).state
    seen = list(prompt)
    for t in steps:
        logits, state = engine.decode_step(t, state)
        seen.append(t)
        want = engine.prefill(seen).logits
        err = float((logits - want).abs().max())
        assert err < TOL, (family, len(seen), err)
