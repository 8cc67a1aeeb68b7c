"""The parity bars against transformers, shared by the per-architecture test files
(tests/engine/models/): all-position prefill logits, a prefill continued chunk by chunk, and greedy decode steps with
identical tokens, every one within TOL (fp32) of transformers' own model on the same checkpoint; a
cached state continued twice; a bf16 load."""
from __future__ import annotations

import torch

from common.engine.hybrid_engine import HybridEngine
from tests.support.tiny import dynamic_cache, hf_chunked_and_greedy, hf_prefill_logits, load_hf, save_tiny

TOL = 1e-4
N_PROMPT, CHUNK, STEPS = 300, 100, 20


def build_case(name: str, model_type: str, kw: dict, out_dir, edit=None, new_cache=dynamic_cache,
               hf_continues_prefill: bool = True) -> dict:
    """Save a tiny random checkpoint (optionally edited by `edit(path)`), run transformers on it,
    load it through our engine (see reference_case)."""
    path = save_tiny(model_type, out_dir, seed=0, **kw)
    if edit is not None:
        edit(path)
    return reference_case(name, path, kw["vocab_size"], new_cache=new_cache,
                          hf_continues_prefill=hf_continues_prefill)


def reference_case(name: str, path, vocab: int, new_cache=dynamic_cache, hf_continues_prefill: bool = True,
                   seed: int = 1) -> dict:
    """transformers' logits on a checkpoint, and our engine loaded from it.

    hf_continues_prefill=False: transformers' model is wrong when a multi-token call continues a
    non-empty cache (MiniMax in transformers 5.23; Jamba, whose torch scan restarts the SSM state at
    zero for a second chunk); the chunked reference is then its full prefill and the decode reference
    starts from a one-call prefill (its single-token decode is right)."""
    hf = load_hf(path)
    ids = torch.randint(0, vocab, (N_PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = hf_prefill_logits(hf, ids)
    chunks = N_PROMPT // CHUNK if hf_continues_prefill else 1
    ref_chunked, ref_tokens, ref_steps = hf_chunked_and_greedy(hf, ids, chunks, STEPS, new_cache)
    if not hf_continues_prefill:
        ref_chunked = ref
    del hf
    eng = HybridEngine.from_pretrained(path, dtype=torch.float32)
    return dict(name=name, path=path, ids=ids, ref=ref, ref_chunked=ref_chunked, ref_tokens=ref_tokens,
                ref_steps=ref_steps, eng=eng)


def _report(case, check, diff):
    print(f"[{case['name']}] {check}: max abs diff {diff:.3g}")


def check_prefill(case):
    assert case["ref"].std() > 0.1, "reference logits too small for a meaningful comparison"
    out = case["eng"].prefill(case["ids"], return_all_logits=True)
    diff = (out.all_logits - case["ref"]).abs().max().item()
    _report(case, "prefill", diff)
    assert diff < TOL
    assert torch.equal(out.logits, out.all_logits[-1])
    return diff


def check_chunked(case):
    out = case["eng"].prefill(case["ids"], chunk_size=CHUNK, return_all_logits=True)
    diff = (out.all_logits - case["ref_chunked"]).abs().max().item()
    _report(case, "chunked prefill", diff)
    assert diff < TOL
    assert (case["ref_chunked"] - case["ref"]).abs().max() < TOL  # the reference agrees with itself
    return diff


def check_greedy(case):
    eng = case["eng"]
    out = eng.prefill(case["ids"], chunk_size=CHUNK)
    logits, state = out.logits, out.state
    tokens, worst = [], 0.0
    for ref_logits in case["ref_steps"]:
        worst = max(worst, (logits - ref_logits).abs().max().item())
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        logits, state = eng.decode_step(tok, state)
    _report(case, "greedy decode", worst)
    assert tokens == case["ref_tokens"]
    assert len(set(tokens)) > 1, "a constant greedy sequence proves little"
    assert worst < TOL
    return tokens, worst


def check_state_not_mutated(case):
    """Continuing a cached state leaves it as it was: the same continuation twice gives the same logits."""
    eng, ids = case["eng"], case["ids"]
    prefix = eng.prefill(ids[:150])
    a = eng.prefill(ids[150:], state=prefix.state).logits
    b = eng.prefill(ids[150:], state=prefix.state).logits
    assert torch.equal(a, b)
    assert (a - case["ref"][-1]).abs().max() < TOL


def check_bf16(case, min_agree: float = 0.9, moe_positions: bool = False):
    """A bf16 load agrees with the fp32 reference on the top-1 token at most positions.

    moe_positions: also 95% of positions within 10% of the logit range — with MoE a near-tie in bf16
    routes a few tokens to other experts (transformers' own bf16 run does the same)."""
    eng16 = HybridEngine.from_pretrained(case["path"], dtype=torch.bfloat16)
    out = eng16.prefill(case["ids"], return_all_logits=True)
    assert torch.isfinite(out.all_logits).all()
    ref = case["ref"]
    agree = (out.all_logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    per_pos = (out.all_logits - ref).abs().amax(-1)
    _report(case, f"bf16 (top-1 agreement {agree:.3f})", per_pos.max().item())
    assert agree > min_agree
    if moe_positions:
        assert (per_pos < 0.1 * ref.abs().max()).float().mean() > 0.95
    return eng16


def resave(src, dst, edit):
    """Copy a tiny checkpoint to `dst` with its tensors changed by `edit(state_dict)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f), metadata={"format": "pt"})
    return dst


def check_loading_error(checkpoint, tensor: str, edit: str, tmp_path):
    """A checkpoint lacking `tensor` ("drop") or with it one row short ("shrink") is refused with a
    CheckpointError naming it."""
    import re

    import pytest

    from common.engine.loader import CheckpointError

    def change(sd):
        if edit == "drop":
            sd.pop(tensor)
        else:
            sd[tensor] = sd[tensor][:-1].clone()

    path = resave(checkpoint, tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=re.escape(tensor)):
        HybridEngine.from_pretrained(path)


# The parity checks every architecture's file runs on its `case` fixture, by name:
#     @pytest.mark.parametrize("check", ["prefill", "chunked", "greedy", "state"])
#     def test_parity(case, check):
#         PARITY_CHECKS[check](case)
PARITY_CHECKS = {
    "prefill": check_prefill,
    "chunked": check_chunked,
    "greedy": check_greedy,
    "state": check_state_not_mutated,
}


def check_matches_transformers(hf, eng, vocab: int = 512):
    """The older one-test form of the bars above (Qwen3.5, Kimi): on a 300-token prompt, all-position
    prefill logits, a prefill in 3 chunks, `generate`'s 20 greedy tokens and the logits before each
    decode step, all within 1e-4 of transformers' `hf`. Returns our state after the decode steps."""
    ids = torch.randint(0, vocab, (300,), generator=torch.Generator().manual_seed(5)).tolist()

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
    return state


def check_prefill_keeps_given_state(eng):
    """Continuing a cached state twice gives the same logits, and the state keeps its length."""
    a = eng.prefill(list(range(40)))
    first = eng.prefill(list(range(40, 60)), state=a.state).logits
    again = eng.prefill(list(range(40, 60)), state=a.state).logits
    assert torch.equal(first, again)
    assert a.state.seq_len == 40
