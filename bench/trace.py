"""A JSONL trace format for reuse workloads: Mooncake's trace fields plus the segments, so that a
trace both says what reuse there was and can be replayed.

    python -m bench.serve --workload agent --n-agent 40 --write-trace agent.jsonl --trace-rate 2
                                                   # write one of the five workloads as a trace
    python -m bench.serve --trace agent.jsonl      # replay it on a mesh of our own, every mode
    python -m bench.serve --address HOST:PORT --trace agent.jsonl   # or against a deployment

One request per line (bench/README.md, "Traces", describes it for users):

    {"timestamp": 1250, "input_length": 1843, "output_length": 8, "hash_ids": [0, 1, 2, 3],
     "segment_ids": ["d17", "d3"], "segments": ["<doc> ...", "<doc> ..."], "query": "<q> find x <a>"}

- `timestamp`, `input_length`, `output_length`, `hash_ids`: Mooncake's fields (FAST'25 traces):
  arrival in milliseconds since the first request, prompt tokens, output tokens, and one id per
  block of BLOCK_TOKENS prompt tokens (the last block may be partial) where a block's id is that of
  its whole prefix: two requests share an id only while their prompts are identical up to the
  end of that block. They describe prefix reuse only, and tools that read Mooncake traces read
  these lines as they are.
- `segment_ids`, `segments`: the prompt's segments in order (the order is the list's), each with
  an id naming its content, so reuse at any position shows: the same id in another request is
  the same segment, wherever it sits. A segment is text or a list of token ids; it may be null
  when its id was given with its content on an earlier line (a compact trace). `query`: the
  request's own text (or token ids) after the segments.

`max_tokens` and `arrival_s` (seconds) are read as `output_length` and `timestamp` when those are
absent (bench/remote.py's earlier trace lines); `shape` (the generator's name) is informational.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

from bench import workloads as W

BLOCK_TOKENS = 512  # Mooncake's block size for hash_ids
Segment = Union[str, list[int]]


@dataclass
class TraceLine:
    index: int
    segments: list[Segment]
    query: Segment
    max_tokens: int
    arrival_s: float = 0.0
    segment_ids: list[Union[str, int]] | None = None
    hash_ids: list[int] | None = None


# ---- writing ---------------------------------------------------------------------------------

class BlockHasher:
    """Mooncake's hash_ids: a block's id is that of its whole prefix (a chained digest), numbered
    consecutively from 0 in order of first appearance across the trace."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS):
        self.block_tokens = block_tokens
        self.ids: dict[bytes, int] = {}

    def __call__(self, tokens: Sequence) -> list[int]:
        out, prev = [], b""
        for at in range(0, len(tokens), self.block_tokens):
            block = json.dumps(list(tokens[at:at + self.block_tokens])).encode()
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            out.append(self.ids.setdefault(prev, len(self.ids)))
        return out


def lines(trace: W.Trace, max_tokens: int, compact: bool = False,
          block_tokens: int = BLOCK_TOKENS) -> Iterable[dict]:
    """The JSON objects of `trace`'s requests (in the bundled model's language: one word = one
    token, segments as text). `compact`: a segment's text only on its id's first line."""
    hasher, seen = BlockHasher(block_tokens), set()
    t0 = min((r.arrival_s for r in trace.requests), default=0.0)
    for r in trace.requests:
        words = [w for s in r.segments for w in s] + list(r.query)
        segs: list = []
        for i, s in zip(r.doc_ids, r.segments):
            segs.append(None if compact and i in seen else " ".join(s))
            seen.add(i)
        yield {"timestamp": int(round((r.arrival_s - t0) * 1000)), "input_length": len(words),
               "output_length": r.max_tokens or max_tokens, "hash_ids": hasher(words),
               "segment_ids": list(r.doc_ids), "segments": segs, "query": " ".join(r.query),
               "shape": r.shape}


def write(path: Path, trace: W.Trace, max_tokens: int, compact: bool = False) -> Path:
    Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines(trace, max_tokens, compact)))
    return Path(path)


# ---- reading ---------------------------------------------------------------------------------

def _segment(x, what: str) -> Segment:
    if isinstance(x, str) and x.strip():
        return x
    if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return x
    raise ValueError(f"{what} must be non-empty text or a non-empty list of token ids")


def _line(obj: dict, index: int, default_max_tokens: int, known: dict) -> TraceLine:
    segs = obj["segments"]
    if not isinstance(segs, list) or not segs:
        raise ValueError("segments must be a non-empty list")
    ids = obj.get("segment_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != len(segs)
                            or not all(isinstance(i, (str, int)) for i in ids)):
        raise ValueError("segment_ids must be a list of strings or integers, one per segment")
    out = []
    for j, s in enumerate(segs):
        sid = None if ids is None else ids[j]
        if s is None:
            if sid is None or sid not in known:
                raise ValueError(f"segment {j} is null but its id was not given with content before")
            s = known[sid]
        s = _segment(s, f"segment {j}")
        if sid is not None and known.setdefault(sid, s) != s:
            raise ValueError(f"segment id {sid!r} names two different contents")
        out.append(s)
    max_tokens = int(obj.get("output_length", obj.get("max_tokens", default_max_tokens)))
    arrival = float(obj["timestamp"]) / 1000 if "timestamp" in obj else float(obj.get("arrival_s", 0.0))
    if max_tokens < 1 or not arrival >= 0:
        raise ValueError("output_length must be >= 1 and timestamp >= 0")
    hash_ids = obj.get("hash_ids")
    if hash_ids is not None and not all(isinstance(h, int) for h in hash_ids):
        raise ValueError("hash_ids must be integers")
    return TraceLine(index, out, _segment(obj["query"], "query"), max_tokens, arrival,
                     None if ids is None else list(ids), hash_ids)


def read(path: Path, default_max_tokens: int) -> list[TraceLine]:
    """The requests of a trace file (ValueError naming the file and line of a malformed one)."""
    out: list[TraceLine] = []
    known: dict = {}
    for n, text in enumerate(Path(path).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            out.append(_line(obj, len(out), default_max_tokens, known))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {type(e).__name__ if isinstance(e, KeyError) else ''}{e}") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def to_trace(trace_lines: Sequence[TraceLine]) -> W.Trace:
    """The lines as bench/serve.py's requests: text split into words (the bundled model's tokens),
    token ids kept; a segment without an id is named by its content."""
    def words(s: Segment) -> tuple:
        return tuple(s.split()) if isinstance(s, str) else tuple(s)

    reqs = []
    for ln in trace_lines:
        segs = [words(s) for s in ln.segments]
        ids = ln.segment_ids or [hashlib.blake2b(repr(s).encode(), digest_size=8).hexdigest() for s in segs]
        reqs.append(W.Request(ln.index, ln.arrival_s, segs, words(ln.query), list(ids),
                              k_drawn=len(segs), shape="trace", max_tokens=ln.max_tokens))
    return W.Trace("trace", reqs, {"n": len(reqs)})


def at_rate(trace: W.Trace, rate: float, seed: int) -> W.Trace:
    """The same requests at a mean rate of `rate` req/s: the recorded arrivals scaled (their
    pattern kept), or Poisson arrivals when the trace has none."""
    last = max((r.arrival_s for r in trace.requests), default=0.0)
    if last <= 0:
        return W.with_arrivals(trace, rate, seed)
    scale = len(trace.requests) / rate / last
    reqs = [W.Request(r.index, r.arrival_s * scale, r.segments, r.query, r.doc_ids, r.k_drawn, r.shape,
                      r.max_tokens) for r in trace.requests]
    return W.Trace(trace.shape, reqs, {**trace.params, "rate": rate})
