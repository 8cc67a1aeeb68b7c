"""Composition on the engine's real linear layers (Qwen3.5 GDN, Kimi KDA, NemotronH Mamba2, Granite 4
Mamba2, OLMo-hybrid GDN with beta in (0, 2), Ring/Ling KDA; MiniMax's conv-free lightning layer: its own file), conv
included: segments summarised alone and composed == one run over the concatenation (fp32)."""
import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.apply import run_warmup
from common.engine.pic.reference import linear_body_reference
from kernels.linear_attn import compose, linear_attention
from tests.support.tiny import PIC_CONFIGS, save_tiny

ARCHS = ["qwen3_5_text", "kimi_linear", "nemotron_h", "granitemoehybrid", "olmo_hybrid", "bailing_hybrid",
         "jamba", "falcon_h1", "zamba2"]


@pytest.fixture(scope="module", params=ARCHS)
def mixer(request, tmp_path_factory):
    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=4, **PIC_CONFIGS[request.param])
    eng = HybridEngine.from_pretrained(path)
    mixer = next(layer for layer in eng.model.layers if layer.kind == "linear").mixer
    # Slow decays (as trained models have in many heads): with a random init's fast decays the
    # first segments are forgotten within a few tokens and every comparison would pass trivially.
    # Ring/Ling's safe gate g = lower_bound * sigmoid(exp(A_log) * u) is slow for a *large* rate (u < 0).
    rate = 16.0 if getattr(mixer, "safe_gate", False) else 0.02
    with torch.no_grad():
        mixer.A_log.copy_(torch.log(torch.full_like(mixer.A_log, rate)))
    return mixer


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("lengths", [(37, 50), (3, 64, 1, 29), (120, 2, 2, 90, 17)])
@torch.inference_mode()
def test_composed_state_equals_full_run(mixer, lengths, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    D = mixer.hidden
    xs = [torch.randn(1, n, D, generator=g) for n in lengths]
    q, k, v, gate, beta, _, _ = mixer.features(torch.cat(xs, 1), None)
    _, S_full = linear_attention(mixer.family, q, k, v, g=gate, beta=beta, scale=mixer.scale)

    S, conv = None, None
    for x in xs:
        body = linear_body_reference(mixer, x, x.shape[1], w=0)  # whole segment cached, as if it began the prompt
        if S is None:
            S = torch.zeros_like(body.S)
            conv = torch.zeros(1, mixer.conv_inputs(x).shape[-1], mixer.conv_kernel - 1)
        S = compose(body.summary, run_warmup(mixer, body, S, conv))
        conv = torch.cat([conv, body.conv_tail], -1)[..., -(mixer.conv_kernel - 1):]
    assert rel(S, S_full) < 1e-5
    # the earlier segments still matter at the end (else the test would prove nothing)
    _, S_last = linear_attention(mixer.family, q[:, -lengths[-1]:], k[:, -lengths[-1]:], v[:, -lengths[-1]:],
                                 g=gate[:, -lengths[-1]:], beta=None if beta is None else beta[:, -lengths[-1]:],
                                 scale=mixer.scale)
    assert rel(S_last, S_full) > 1e-3

    # without the conv warm-up patch the composed state is measurably wrong
    S_nopatch = None
    for x in xs:
        body = linear_body_reference(mixer, x, x.shape[1], w=0)
        S0 = torch.zeros_like(body.S) if S_nopatch is None else S_nopatch
        S_zero_conv = run_warmup(mixer, body, S0, torch.zeros(1, conv.shape[1], mixer.conv_kernel - 1))
        S_nopatch = compose(body.summary, S_zero_conv)
    assert rel(S_nopatch, S_full) > 100 * max(rel(S, S_full), 1e-7)
