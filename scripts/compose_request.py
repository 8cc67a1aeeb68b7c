"""One request through a running mesh (scripts/compose-check.sh), checked against the engine.

The prompt is held-out retrieval prompt INDEX of the quality evaluation (bench/quality/tasks.py):
its documents are the segments, its question the query. The mesh's greedy tokens must equal
the in-process engine's (the plain reference: same model, dtype float32 on CPU, the router's
seam, hypic mode); the expected answer of the task is printed beside them (the tiny model may
miss it; the comparison with the engine is what is checked). Exit 1 on a mismatch.

    python scripts/compose_request.py --address 127.0.0.1:23051 --index 0 \
        --tls-ca secrets/ca.pem --api-key-file secrets/api-key
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hypic  # noqa: E402
from bench.quality.eval import load_engine, prompt_ids  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "hypic-tiny-qwen35"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tls-ca")
    ap.add_argument("--api-key-file")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    engine = load_engine(args.model)
    segments, query, answer = prompt_ids(engine, "retrieval", args.index)
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    with hypic.Client(args.address, timeout=args.timeout, tls=bool(args.tls_ca), tls_ca=args.tls_ca,
                      api_key=api_key) as client:
        seam = client.info().seam
        t = time.monotonic()
        res = client.generate(segments=segments, query=query, max_tokens=args.max_tokens,
                              stream=False, stop_at_eos=False)
        ms = (time.monotonic() - t) * 1000
    out = engine.prefill_segments(segments, query, mode="hypic", seam=seam)
    reference = engine.generate(out, max_new_tokens=args.max_tokens)
    timings = res.timings
    report = {
        "index": args.index, "ms": round(ms), "segments": len(segments),
        "prompt_tokens": sum(map(len, segments)) + len(query),
        "hits": timings.hits if timings else None, "misses": timings.misses if timings else None,
        "tokens": res.tokens, "text": res.text, "reference": reference,
        "expected_answer": engine.tokenizer.decode(answer),
        "equal": res.tokens == reference,
    }
    print(json.dumps(report), flush=True)
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
