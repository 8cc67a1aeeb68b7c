"""What each entry storage format (common.engine.pic.compact: fp32, bf16, fp8t, fp8) costs in accuracy.

    python -m bench.entry_format_error [--out bench/results/entry_format_error.json] [--models a,b]

1. Composition, every linear family: four segments of random inputs (odd lengths, 4 heads, K = V =
   32) are summarised in fp32, their T and S stored in each format, and composed (fp32) from a random
   incoming state. Relative error (Frobenius) of the end state against the same composition with fp32
   entries (what the format adds) and against an fp64 reference (the whole concatenation run in fp64
   from the same incoming state: the total error).
2. Next-token distribution, every architecture's tiny random model (tests.support.tiny): three
   segments and a query, prefilled with hypic reuse of entries stored in each format; KL(full || hypic)
   in nats at the query's last token against full recompute, and KL(hypic fp32 entries || format).
   Beside the formats, "fp8_kv_model": fp8 T and S with the keys and values left in the model dtype
   (what fp8 entries held before their K/V were stored in e4m3): what the K/V compression costs on
   top of fp8's T and S.
3. The same on the mid-size random model (bench.random_model, --random-model; '' to skip): longer
   segments (MID_LENGTHS) on a model of a realistic shape, whose states are larger.

Small sizes for 1 and 2: they run on the CPU in a minute or two; 3 adds a few minutes.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.random_model import describe, parse_spec, save_random_model
from common.engine.hybrid_engine import HybridEngine
from common.engine.pic.compact import ENTRY_FORMATS, round_trip
from common.engine.pic.entry import AttentionBody, SegmentEntry
from kernels.linear_attn import Summary, prefill_with_summary, segment_summary
from kernels.linear_attn.families import DELTA_FAMILIES, FAMILIES, FAMILY_GATE
from kernels.linear_attn.summary import compose_chain
from tests.support.tiny import PIC_CONFIGS, save_tiny

SEGMENT_LENGTHS = (37, 5, 64, 101)
H, K, V = 4, 32, 32
TINY_LENGTHS, TINY_QUERY = (23, 9, 40), 6  # segments and query of the tiny models' prompt
MID_LENGTHS, MID_QUERY = (96, 29, 160), 8  # the mid-size random model's


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def family_inputs(family: str, n: int, gen: torch.Generator) -> tuple:
    """k, v, g, beta [1, n, ...] fp64 for one family (slow decay: 0.01-0.1 nats per token)."""
    k, v = torch.randn(1, n, H, K, generator=gen, dtype=torch.float64), torch.randn(1, n, H, V, generator=gen,
                                                                                     dtype=torch.float64)
    if family in DELTA_FAMILIES:
        k = F.normalize(k, dim=-1)
    shape = {"head": (H,), "token": (1, n, H), "channel": (1, n, H, K), None: None}[FAMILY_GATE[family]]
    g = None if shape is None else -(0.01 + 0.09 * torch.rand(*shape, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, n, H, generator=gen, dtype=torch.float64) if family in DELTA_FAMILIES else None
    return k, v, g, beta


def _slice(x, a, b):
    return None if x is None or x.dim() == 1 else x[:, a:b]


def composition_error(family: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    k, v, g, beta = family_inputs(family, sum(SEGMENT_LENGTHS), gen)
    S_in = torch.randn(1, H, K, V, generator=gen, dtype=torch.float64)
    # fp64 reference: the segments run one after the other from S_in, in fp64 (the segments' own
    # states from zero plus each one's exact transition of the incoming state; Summary's T is fp32)
    cuts = [0]
    for n in SEGMENT_LENGTHS:
        cuts.append(cuts[-1] + n)
    parts = [(_slice(k, a, b), _slice(v, a, b), g if g is not None and g.dim() == 1 else _slice(g, a, b),
              _slice(beta, a, b)) for a, b in zip(cuts, cuts[1:])]
    sums64 = [segment_summary(family, pk, pv, g=pg, beta=pb) for pk, pv, pg, pb in parts]
    ref = S_in.clone()
    for p, s in zip(parts, sums64):
        ref = _apply64(family, p, ref) + s.S.double()
    sums32 = [segment_summary(family, pk.float(), pv.float(), g=None if pg is None else pg.float(),
                              beta=None if pb is None else pb.float()) for pk, pv, pg, pb in parts]
    fp32_out = compose_chain(sums32, S_in.float())
    out = {"form": sums32[0].form}
    for fmt in ENTRY_FORMATS:
        stored = [Summary(round_trip(s.T, fmt, "T") if s.form == "matrix" else s.T, round_trip(s.S, fmt, "S"), s.form)
                  for s in sums32]
        got = compose_chain(stored, S_in.float())
        out[fmt] = dict(vs_fp32_entries=rel(got, fp32_out), vs_fp64=rel(got, ref))
    return out


def _apply64(family: str, part, S: torch.Tensor) -> torch.Tensor:
    """T . S in fp64 for one segment: the segment run from S with zero values (exactly T S)."""
    pk, pv, pg, pb = part
    _, end, _ = prefill_with_summary(family, torch.zeros_like(pk), pk, torch.zeros_like(pv), g=pg, beta=pb,
                                     initial_state=S)
    return end.double()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return max((p.exp() * (p - q)).sum().item(), 0.0)


def model_kl(path: Path, seed: int, lengths=TINY_LENGTHS, query_len: int = TINY_QUERY) -> dict:
    """Per format: KL at the query's last token of hypic (seam 8) with entries stored in that format
    against full recompute and against fp32 entries, and the entries' bytes; random token ids."""
    eng = HybridEngine.from_pretrained(path, dtype=torch.float32, load_tokenizer=False)
    gen = torch.Generator().manual_seed(seed)
    segs = [torch.randint(0, eng.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    query = torch.randint(0, eng.vocab_size, (query_len,), generator=gen).tolist()
    full = eng.prefill_segments(segs, query, mode="full").logits
    e32 = [eng.build_entry(s, 8) for s in segs]
    out, fp32_logits = {}, None
    for fmt in (*ENTRY_FORMATS, KV_MODEL):
        entries = [SegmentEntry.from_bytes(e.with_format(fmt).to_bytes()) for e in e32] if fmt != KV_MODEL \
            else [_fp8_kv_model(e) for e in e32]
        logits = eng.prefill_segments(segs, query, entries=entries, seam=8).logits
        fp32_logits = logits if fmt == "fp32" else fp32_logits
        out[fmt] = dict(kl_vs_full=_kl(full, logits), kl_vs_fp32_entries=_kl(fp32_logits, logits),
                        entry_bytes=sum(len(e.to_bytes()) for e in entries) if fmt != KV_MODEL else None)
    return out


KV_MODEL = "fp8_kv_model"  # fp8 T and S, keys and values as built (an fp8 entry before version 5)


def _fp8_kv_model(e32: SegmentEntry) -> SegmentEntry:
    """e32 with fp8 T and S as a reader sees them and its keys and values as they are (in memory:
    this code writes such entries no more, it only reads them)."""
    e8 = e32.with_format("fp8")
    layers = [raw if isinstance(raw, AttentionBody) else b for b, raw in zip(e8.layers, e32.layers)]
    return SegmentEntry(e8.token_ids, e8.seam, e8.model_fingerprint, e8.dtype, layers, "fp8")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/entry_format_error.json")
    ap.add_argument("--models", default=",".join(sorted(PIC_CONFIGS)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-model", default="hidden=1024,layers=16,ratio=3:1",
                    help="the mid-size random model's spec (bench.random_model); '' to skip")
    ap.add_argument("--mid-size-only", action="store_true",
                    help="only the mid-size random model's figures, added to the results already at --out")
    a = ap.parse_args()
    t0 = time.time()
    if a.mid_size_only:
        res = json.loads(Path(a.out).read_text())
        with tempfile.TemporaryDirectory() as d:
            res["next_token_mid_size"] = mid_size_kl(a.random_model, a.seed + 5, Path(d))
        res["mid_size_seconds"] = round(time.time() - t0, 1)
        res.setdefault("next_token_tiny_prompt", dict(segment_lengths=TINY_LENGTHS, query_tokens=TINY_QUERY))
        Path(a.out).write_text(json.dumps(res, indent=1))
        print("wrote", a.out)
        return
    comp = {f: composition_error(f, a.seed + i) for i, f in enumerate(FAMILIES) if f != "mamba"}
    for f, r in comp.items():
        print(f"{f:16s} {r['form']:7s} " + " ".join(
            f"{fmt}: {r[fmt]['vs_fp32_entries']:.1e}/{r[fmt]['vs_fp64']:.1e}" for fmt in ENTRY_FORMATS))
    kl = {}
    with tempfile.TemporaryDirectory() as d:
        for m in a.models.split(","):
            path = save_tiny(m, Path(d) / m, seed=a.seed + 5, **PIC_CONFIGS[m])
            kl[m] = model_kl(path, a.seed + 5)
            _print_kl(m, kl[m])
        mid = mid_size_kl(a.random_model, a.seed + 5, Path(d)) if a.random_model else None
    res = dict(seed=a.seed, segment_lengths=SEGMENT_LENGTHS, heads=H, K=K, V=V, composition=comp, next_token=kl,
               next_token_tiny_prompt=dict(segment_lengths=TINY_LENGTHS, query_tokens=TINY_QUERY),
               next_token_mid_size=mid,
               seconds=round(time.time() - t0, 1),
               note="composition: relative Frobenius error of the end state (vs fp32 entries / vs fp64 run); "
                    "next_token: KL nats at the query's last token (vs full recompute / vs fp32 entries)")
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


def mid_size_kl(spec: str, seed: int, tmp: Path) -> dict:
    """model_kl on the mid-size random model `spec` (bench.random_model), with longer segments."""
    spec = parse_spec(spec)
    path = save_random_model(spec, tmp / "random")
    mid = dict(model=describe(spec), segment_lengths=MID_LENGTHS, query_tokens=MID_QUERY,
               **model_kl(path, seed, MID_LENGTHS, MID_QUERY))
    _print_kl("mid-size random", mid)
    return mid


def _print_kl(name: str, r: dict) -> None:
    print(f"{name:18s} " + " ".join(f"{fmt}: {r[fmt]['kl_vs_full']:.1e}/{r[fmt]['kl_vs_fp32_entries']:.1e}"
                                    for fmt in (*ENTRY_FORMATS, KV_MODEL)))


if __name__ == "__main__":
    main()
