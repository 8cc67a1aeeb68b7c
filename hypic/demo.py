"""`make demo`: answer a small RAG session with the bundled model.

Until the mesh lands this runs the engine in-process: it builds one entry per document, answers
the question by reuse prefill (hypic) and by full recompute, and prints both answers and TTFTs.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "hypic-tiny-qwen35"


def _tiny_random_model(out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def main() -> int:
    import tempfile

    from common.engine import HybridEngine

    torch.set_flush_denormal(True)
    tmp = None
    path = BUNDLED
    if not (path / "config.json").exists():
        tmp = tempfile.TemporaryDirectory()
        path = _tiny_random_model(Path(tmp.name))
        print(f"(bundled model not found; using a random tiny Qwen3.5 at {path})")
    eng = HybridEngine.from_pretrained(path)
    tok = eng.tokenizer
    if tok is not None:
        docs = ["<doc> alice likes tea . bob likes milk .", "<doc> carol likes juice . dan likes water ."]
        segments = [tok.encode(d) for d in docs]
        query = tok.encode("<q> carol likes")
    else:
        g = torch.Generator().manual_seed(0)
        segments = [torch.randint(0, eng.vocab_size, (n,), generator=g).tolist() for n in (64, 48, 80)]
        query = torch.randint(0, eng.vocab_size, (6,), generator=g).tolist()
    t0 = time.perf_counter()
    full = eng.prefill_segments(segments, query, mode="full")
    t_full = time.perf_counter() - t0
    cold = eng.prefill_segments(segments, query, mode="hypic")
    entries = cold.extra["entries"]
    t0 = time.perf_counter()
    warm = eng.prefill_segments(segments, query, entries=entries, mode="hypic")
    t_warm = time.perf_counter() - t0
    ans_full = eng.generate(full, max_new_tokens=8)
    ans_warm = eng.generate(warm, max_new_tokens=8)
    show = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: str(ids))
    print(f"model: {eng.model_type} from {path}")
    print(f"full recompute: {show(ans_full)!s:40}  TTFT {t_full * 1e3:.1f} ms")
    print(f"hypic (warm):   {show(ans_warm)!s:40}  TTFT {t_warm * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
