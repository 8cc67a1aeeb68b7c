"""Causal attention of new queries over a per-layer key/value state."""
import torch
import torch.nn.functional as F

from common.state import AttentionLayerState


def append_kv(state: AttentionLayerState | None, k: torch.Tensor, v: torch.Tensor) -> AttentionLayerState:
    if state is None:
        return AttentionLayerState(k, v)
    return AttentionLayerState(torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2))


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, Tq, D]; keys/values [B, Hkv, Tk, D] whose last Tq entries belong to the queries.

    Query i sees keys 0 .. Tk - Tq + i (everything before it plus itself). Returns [B, Tq, Hq, Dv].
    """
    Tq, Tk = q.shape[2], keys.shape[2]
    n_rep = q.shape[1] // keys.shape[1]
    if n_rep > 1:
        keys = keys.repeat_interleave(n_rep, dim=1)
        values = values.repeat_interleave(n_rep, dim=1)
    if Tq == 1:
        out = F.scaled_dot_product_attention(q, keys, values, scale=scale)
    elif Tq == Tk:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    else:
        past = Tk - Tq
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(Tk, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=j <= past + i, scale=scale)
    return out.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: AttentionLayerState | None, scale: float,
           ctx) -> tuple[torch.Tensor, AttentionLayerState]:
    """What every full-attention mixer calls: add this call's keys/values to the layer state and
    attend causally. q [B,Hq,T,D], k/v [B,Hkv,T,D] (rotated) -> (o [B,T,Hq,Dv], new state).

    Under a batched seam-recompute plan (common.pic) the new keys belong to several seams spread
    between cached segment bodies; the plan lays them out and masks by real position.
    """
    if ctx is not None and ctx.plan is not None:
        return ctx.plan.attend(q, k, v, scale, ctx)
    new_state = append_kv(state, k, v)
    return causal_attention(q, new_state.keys, new_state.values, scale), new_state
