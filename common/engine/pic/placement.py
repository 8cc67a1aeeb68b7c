"""Placing a parsed segment entry on the device and in the dtypes the engine composes with.

An entry is parsed from bytes on the host (SegmentEntry.from_bytes views the received buffer);
before any of its tensors meets the model (SeamPlan, compose_run, compose_and_query, decode) it
must live on the engine's device, or a combine on CUDA would mix host and device tensors on its
first warm request (issue 25). The dtypes are the ones composition needs, whatever the payload
held:

- T and S (linear layers): fp32 — summaries are composed in fp32 (kernels.compose accumulates
  in fp32 and the composed state is the fp32 recurrent state the model continues from);
- conv tails, warm-up inputs, keys and values: the model's dtype (they are concatenated with,
  or fed to, the model's own activations).

`place_entry` is the one function that does it; the combine calls it where it parses entries.
A tensor already where it belongs is kept as is (no copy), so on a CPU engine in the entry's
dtype this is free.
"""
from __future__ import annotations

import torch

from common.engine.pic.entry import AttentionBody, LinearBody, SegmentEntry

SUMMARY_DTYPE = torch.float32  # T and S: what composition reads and writes


def _put(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    # blocking copy: a device -> host move with non_blocking could be read before it lands
    return None if t is None else t.to(device=device, dtype=dtype)


def place_layer(body, device: torch.device, dtype: torch.dtype):
    """One layer's body on `device`: T, S in fp32, everything else in `dtype`."""
    if isinstance(body, LinearBody):
        return LinearBody(T=_put(body.T, device, SUMMARY_DTYPE), form=body.form, S=_put(body.S, device, SUMMARY_DTYPE),
                          conv_tail=_put(body.conv_tail, device, dtype),
                          warmup_inputs=_put(body.warmup_inputs, device, dtype))
    if isinstance(body, AttentionBody):
        return AttentionBody(_put(body.keys, device, dtype), _put(body.values, device, dtype))
    return body


def place_entry(entry: SegmentEntry, device: torch.device | str, dtype: torch.dtype) -> SegmentEntry:
    """`entry` with every tensor on `device`: T and S fp32, conv tails, warm-up inputs, keys and
    values in `dtype` (the model's). A new SegmentEntry; the given one is not changed."""
    device = torch.device(device)
    layers = [place_layer(b, device, dtype) for b in entry.layers]
    return SegmentEntry(entry.token_ids, entry.seam, entry.model_fingerprint, entry.dtype, layers,
                        format=entry.format)


def place_for_engine(entry: SegmentEntry, engine) -> SegmentEntry:
    """`place_entry` on the engine's device, in the engine's dtype."""
    return place_entry(entry, engine.device, engine.dtype)


def entry_placement(entry: SegmentEntry) -> list[tuple[str, torch.device, torch.dtype]]:
    """(name, device, dtype) of every tensor of `entry` (for checks and tests)."""
    out = []
    for i, b in enumerate(entry.layers):
        if isinstance(b, LinearBody):
            named = {"T": b.T, "S": b.S, "conv": b.conv_tail, "warm": b.warmup_inputs}
        elif isinstance(b, AttentionBody):
            named = {"k": b.keys, "v": b.values}
        else:
            named = {}
        out += [(f"{i}.{n}", t.device, t.dtype) for n, t in named.items() if t is not None]
    return out
