"""Kimi-Linear entries hold the MLA latents (normed c and k_rot, one shared head), not up-projected
keys/values: the attention part of an entry is what the model's own KV cache holds. Measured
bytes per cached token against the up-projected layout, and exact reuse from latent entries."""
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.pic import AttentionBody, SegmentEntry
from tests.support.tiny import PIC_CONFIGS, save_tiny


def test_entry_stores_latents_and_reuses_exactly(tmp_path, fresh_seed):
    kw = PIC_CONFIGS["kimi_linear"]
    eng = HybridEngine.from_pretrained(save_tiny("kimi_linear", tmp_path / "m", seed=2, **kw))
    g = torch.Generator().manual_seed(fresh_seed)
    segs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (60, 45)]
    q = torch.randint(0, 512, (5,), generator=g).tolist()
    entry = SegmentEntry.from_bytes(eng.build_entry(segs[0], seam=4).to_bytes())
    bodies = [b for b in entry.layers if isinstance(b, AttentionBody)]
    r, rope = kw["kv_lora_rank"], kw["qk_rope_head_dim"]
    up = kw["num_attention_heads"] * (kw["qk_nope_head_dim"] + rope + kw["v_head_dim"])
    for b in bodies:
        assert b.keys.shape == (1, 1, 56, r + rope) and b.values.numel() == 0
        per_token = (b.keys.numel() * b.keys.element_size() + b.values.numel() * b.values.element_size()) / 56
        assert per_token == (r + rope) * 4  # fp32 model
    print(f"\nMLA bytes per cached token per layer: latents {(r + rope) * 4}, up-projected {up * 4} "
          f"({up / (r + rope):.1f}x)")
    # reuse from latent entries is exact where the seams cover the segments, both orders
    full = eng.prefill_segments(segs, q, mode="full").logits
    for order in ("segment", "layer"):
        hyp = eng.prefill_segments(segs, q, mode="hypic", seam=60, order=order).logits
        assert (hyp - full).abs().max() < 1e-4, order
