"""Causal attention of new queries over a per-layer key/value state."""
import torch
import torch.nn.functional as F

from common.engine.state import AttentionLayerState


def append_kv(state: AttentionLayerState | None, k: torch.Tensor, v: torch.Tensor) -> AttentionLayerState:
    if state is None:
        return AttentionLayerState(k, v)
    return AttentionLayerState(torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2))


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, Tq, D]; keys/values [B, Hkv, Tk, D] whose last Tq entries belong to the queries.

    Query i sees keys 0 .. Tk - Tq + i (everything before it plus itself). Returns [B, Tq, Hq, Dv].
    `causal_attention_reference` is the plain definition; tests hold the two together.
    """
    Tq, Tk = q.shape[2], keys.shape[2]
    if 1 < Tq < Tk and flash_blocks_available(q, values):
        return _past_and_diagonal(q, keys, values, scale).transpose(1, 2)
    keys, values = _repeat_kv(keys, values, q.shape[1])
    if Tq == 1:
        out = F.scaled_dot_product_attention(q, keys, values, scale=scale)
    elif Tq == Tk:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    else:  # other devices: a lower-right causal bias, which CUDA kernels take without a mask
        # Imported here: torch.nn.attention.bias imports torch._dynamo, 2.5 s of CPU at every
        # worker's start, and the CPU path above never needs it.
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(Tq, Tk), scale=scale)
    return out.transpose(1, 2)


# The CPU flash kernel returns the log-sum-exp beside the output, which lets attention calls over
# disjoint key ranges be merged exactly (`flash_block` + `merge_blocks`; common.engine.pic.seam_plan's seam
# attention is built from the same two). (A [Tq, Tk] boolean mask would become a float mask inside
# SDPA, cost ~20% at 2x2048 and stop the kernel from skipping masked blocks.)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_blocks_available(q: torch.Tensor, values: torch.Tensor) -> bool:
    return _CPU_FLASH is not None and q.device.type == "cpu" and q.shape[-1] == values.shape[-1]


def flash_block(q, keys, values, scale: float, causal: bool):
    """(out [B, Hq, Tq, Dv], lse [B, Hq, Tq]) of q over one block of keys: all of them, or with
    causal=True a block whose keys are the queries' own (Tq == Tk, top-left causal). Over a whole
    block the query heads are grouped by their kv head, so no key/value copy per query head."""
    if causal:
        keys, values = _repeat_kv(keys, values, q.shape[1])
        return _CPU_FLASH(q, keys, values, 0.0, True, scale=scale)[:2]
    B, Hq, Tq, D = q.shape
    Hkv = keys.shape[1]
    o, lse = _CPU_FLASH(q.reshape(B, Hkv, (Hq // Hkv) * Tq, D), keys, values, 0.0, False, scale=scale)[:2]
    return o.reshape(B, Hq, Tq, -1), lse.reshape(B, Hq, Tq)


def merge_blocks(o_a, lse_a, o_b, lse_b):
    """Two blocks' attention over disjoint keys as one (float32): (out, lse). A block of no keys
    so far (lse -inf) weighs nothing."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    return o_a.float() * (lse_a - lse).exp()[..., None] + o_b.float() * (lse_b - lse).exp()[..., None], lse


def _past_and_diagonal(q, keys, values, scale) -> torch.Tensor:
    """Causal attention with an offset: the past keys (no mask) and the queries' own block
    (causal) in two flash calls, merged by log-sum-exp. Returns [B, Hq, Tq, Dv]."""
    past = keys.shape[2] - q.shape[2]
    o_p, lse_p = flash_block(q, keys[:, :, :past], values[:, :, :past], scale, causal=False)
    o_d, lse_d = flash_block(q, keys[:, :, past:], values[:, :, past:], scale, causal=True)
    return merge_blocks(o_p, lse_p, o_d, lse_d)[0].to(q.dtype)


def _repeat_kv(keys, values, n_heads: int):
    n_rep = n_heads // keys.shape[1]
    if n_rep > 1:
        keys = keys.repeat_interleave(n_rep, dim=1)
        values = values.repeat_interleave(n_rep, dim=1)
    return keys, values


def causal_attention_reference(q, keys, values, scale: float) -> torch.Tensor:
    """The definition, in float64 math: softmax over keys 0 .. Tk - Tq + i for query i."""
    Tq, Tk = q.shape[2], keys.shape[2]
    keys, values = _repeat_kv(keys, values, q.shape[1])
    scores = (q.double() @ keys.double().transpose(-1, -2)) * scale
    i = torch.arange(Tq, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    scores = scores.masked_fill(j > Tk - Tq + i, float("-inf"))
    return (scores.softmax(-1) @ values.double()).to(q.dtype).transpose(1, 2)


def attention_values(mixer, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The values a mixer attends over: its stored values, or for MLA latents (Kimi, whose values
    are the first `latent_values` channels of the keys, stored once) a view of the keys."""
    n = getattr(mixer, "latent_values", None)
    return keys[..., :n] if n else values


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: AttentionLayerState | None, scale: float,
           ctx) -> tuple[torch.Tensor, AttentionLayerState]:
    """What every full-attention mixer calls: add this call's keys/values to the layer state and
    attend causally. q [B,Hq,T,D], k/v [B,Hkv,T,D] (rotated) -> (o [B,T,Hq,Dv], new state).

    Under a batched seam-recompute plan (common.engine.pic) the new keys belong to several seams spread
    between cached segment bodies; the plan lays them out and masks by real position.
    """
    if ctx is not None and ctx.plan is not None:
        return ctx.plan.attend(q, k, v, scale, ctx)
    new_state = append_kv(state, k, v)
    return causal_attention(q, new_state.keys, new_state.values, scale), new_state
