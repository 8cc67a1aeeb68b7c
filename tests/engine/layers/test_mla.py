"""The one MLA (common.engine.layers.mla.LatentAttention) against its plain definition on random
weights and inputs: keys and values up-projected per head, RoPE (interleaved pairs) on the shared
k_rot and q_rot, causal softmax in float64, the per-head gate, the output projection. Both options
the served models use (Kimi-Linear: no rotary, q LoRA; bailing_hybrid: rotary, gate, `dense`), in
one call and continuing from a cached state (latents kept, values zero-width)."""
from types import SimpleNamespace

import pytest
import torch

from common.engine.layers.attention import causal_attention_reference
from common.engine.layers.mla import LatentAttention
from common.engine.layers.rotary import RotaryEmbedding
from common.engine.models.base import ForwardContext

H, NOPE, ROPE, V, R, D = 4, 16, 8, 12, 24, 48
OPTIONS = {
    "kimi": dict(q_lora_rank=16, rotary=False, output_gate=False, out_proj="o_proj"),
    "bailing": dict(q_lora_rank=None, rotary=True, output_gate=True, out_proj="dense"),
}


def make_mla(option: str, seed: int) -> LatentAttention:
    o = OPTIONS[option]
    cfg = SimpleNamespace(hidden_size=D, num_attention_heads=H, q_lora_rank=o["q_lora_rank"], kv_lora_rank=R,
                          qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V)
    rotary = RotaryEmbedding(ROPE, 10000.0) if o["rotary"] else None
    mla = LatentAttention(cfg, rotary, output_gate=o["output_gate"], out_proj=o["out_proj"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mla.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return mla


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """DeepSeek's RoPE as written: pairs (x[2i], x[2i+1]) turned by position * theta^(-2i/d), the
    result laid out evens then odds (how the layer stores it)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * freq[None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)


def mla_reference(mla: LatentAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Output over all of x (every token attends causally to those before it), float64 throughout."""
    m = {n: p.double() for n, p in mla.named_parameters()}
    x = x.double()
    B, T, _ = x.shape

    def rms(h, w):
        return w * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    if mla.q_lora_rank is None:
        q = x @ m["q_proj.weight"].T
    else:
        q = rms(x @ m["q_a_proj.weight"].T, m["q_a_layernorm.weight"]) @ m["q_b_proj.weight"].T
    q = q.view(B, T, H, NOPE + ROPE).transpose(1, 2)
    latent, k_rot = (x @ m["kv_a_proj_with_mqa.weight"].T).split([R, ROPE], -1)
    kv = (rms(latent, m["kv_a_layernorm.weight"]) @ m["kv_b_proj.weight"].T).view(B, T, H, NOPE + V).transpose(1, 2)
    k_nope, v = kv.split([NOPE, V], -1)
    q_nope, q_rot = q.split([NOPE, ROPE], -1)
    k_rot = k_rot.unsqueeze(1)
    if mla.rotary is not None:
        q_rot, k_rot = interleaved_rope(q_rot, positions), interleaved_rope(k_rot, positions)
    keys = torch.cat([k_nope, k_rot.expand(B, H, T, ROPE)], -1)
    o = causal_attention_reference(torch.cat([q_nope, q_rot], -1), keys, v, (NOPE + ROPE) ** -0.5)  # [B,T,H,V]
    if mla.g_proj is not None:
        o = o * torch.sigmoid(x @ m["g_proj.weight"].T).unsqueeze(-1)
    return o.reshape(B, T, H * V) @ m[f"{mla.out_proj_name}.weight"].T


@pytest.mark.parametrize("option", sorted(OPTIONS))
@torch.inference_mode()
def test_latent_attention_equals_the_up_projected_definition(option, fresh_seed):
    mla = make_mla(option, fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed + 1)
    start = fresh_seed % 500  # positions need not begin at 0
    x = torch.randn(2, 13, D, generator=g)
    positions = torch.arange(start, start + 13)
    want = mla_reference(mla, x, positions)
    got, state = mla(x, None, ForwardContext(positions=positions))
    assert state.keys.shape == (2, 1, 13, R + ROPE) and state.values.shape == (2, 1, 13, 0)
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()
    # the same tokens in two calls, the second attending over the first's cached latents
    head, cached = mla(x[:, :8], None, ForwardContext(positions=positions[:8]))
    tail, _ = mla(x[:, 8:], cached, ForwardContext(positions=positions[8:]))
    assert (torch.cat([head, tail], 1).double() - want).abs().max() < 1e-4 * want.abs().max()
    assert mla.out_proj_name == OPTIONS[option]["out_proj"] and hasattr(mla, OPTIONS[option]["out_proj"])

