"""Request traces for bench/serve.py: RAG, multi-document summarization, agent tool use, multi-turn
chat and few-shot in-context learning.

Everything is written in the closed language of bench/quality/tasks.py (the bundled model's
word-level vocabulary: one word = one token), so a document of `n` words is a segment of `n`
tokens for the bundled model. All randomness comes from `random.Random` seeded with integers:
the same arguments always give the same trace.

    corpus = make_corpus(200, (128, 2048), seed=1)
    trace = rag_trace(corpus, 16, seed=2, rate=2.0)      # Poisson arrivals at 2 req/s
    for r in trace.requests: r.arrival_s, r.segments, r.query, r.doc_ids

Shapes
- RAG: a corpus of documents of 128-2048 tokens (log-uniform lengths). A request draws k in
  [k_min, k_max] documents without replacement with Zipf popularity (the document of rank r has
  weight 1/r^s; ranks are a random permutation of the corpus, independent of length), in random
  order, then truncates the list to a prompt budget (`max_prompt_tokens`: a retriever's top-k cut
  by the context budget), plus a question `<q> find KEY <a>` about one of the chosen documents.
- Summarization: few long segments (2-4 documents of 768-2048 tokens from a small pool, Zipf),
  question `<q> count NAME <a>` (aggregate over all documents).
- Agent: many short segments. A session has a fixed set of tool descriptions (drawn once per
  session from a shared pool, in the session's order), then per turn the memory files retrieved
  for that turn (2-4 from a shared pool, Zipf, random order), then the last few earlier turns of
  the session (in order), and the new user message as the query. Sessions are interleaved. A
  tool description is reused by every session that drew it, each in its own order.
- Chat: multi-turn conversations. A session's first segment is its system prompt (one of a small
  shared pool, Zipf), then its earlier turns in order (the last `turn_window`), and the new user
  message as the query; once a session is longer than the window its oldest turn drops out, so
  the prompt's prefix changes while most of its segments stay the same. Sessions are interleaved.
- Few-shot: in-context learning. A request picks a task (Zipf over a few), then its instruction
  segment, then k examples drawn from that task's pool (Zipf, without replacement, random order),
  and a question about one example: the same examples recur in other subsets and orders.

Arrivals: `rate` (requests/s) gives Poisson arrivals (exponential inter-arrival times, mean
1/rate); rate=None gives arrival_s = 0 for all, to be driven at a fixed concurrency.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from bench.quality import tasks as T

SHAPES = ("rag", "summarization", "agent", "chat", "fewshot")  # the five workloads, in report order

# the language's word classes (bench.quality.tasks)
FILLER, KEYS, VALUES, NAMES = T.FILLER_WORDS, T.KEYS, T.VALUES, T.NAMES


@dataclass(frozen=True)
class Document:
    id: int
    words: tuple[str, ...]        # starts with "<doc>"; one word = one token
    keys: tuple[str, ...]         # fact keys stated in it (for questions)
    names: tuple[str, ...]        # names mentioned in it

    @property
    def n_tokens(self) -> int:
        return len(self.words)

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class Request:
    index: int
    arrival_s: float                      # offset from the start of the run (0: closed loop)
    segments: list[tuple[str, ...]]       # each a tuple of words
    query: tuple[str, ...]
    doc_ids: list[int]                    # ids of the segments (corpus / pool ids), in order
    k_drawn: int = 0                      # documents drawn before the prompt budget cut (RAG)
    shape: str = "rag"
    max_tokens: int | None = None         # this request's output budget (a replayed trace's); None: the run's

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments) + len(self.query)


@dataclass
class Trace:
    shape: str
    requests: list[Request]
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def summary(self) -> dict:
        rs = self.requests
        if not rs:
            return {"shape": self.shape, "n": 0, **self.params}
        toks = sorted(r.prompt_tokens for r in rs)
        segs = [len(r.segments) for r in rs]
        seg_toks = [len(s) for r in rs for s in r.segments]
        return {
            "shape": self.shape, "n": len(rs), **self.params,
            "segments_mean": sum(segs) / len(segs), "segments_min": min(segs), "segments_max": max(segs),
            "segment_tokens_mean": sum(seg_toks) / len(seg_toks),
            "prompt_tokens_mean": sum(toks) / len(toks), "prompt_tokens_max": toks[-1],
            "k_drawn_mean": sum(r.k_drawn for r in rs) / len(rs),
        }


# ---- documents ---------------------------------------------------------------------------------

def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_document(rng: random.Random, doc_id: int, n_tokens: int, facts_per_100: float = 2.5) -> Document:
    """A document of exactly `n_tokens` words: `<doc>`, facts `KEY VALUE .` (distinct keys),
    name mentions and filler, shuffled with each fact's three words kept together."""
    n_tokens = max(8, int(n_tokens))
    body = n_tokens - 1
    n_facts = max(1, min(len(KEYS), int(body * facts_per_100 / 100)))
    n_facts = min(n_facts, (body - 1) // 3)
    keys = rng.sample(KEYS, n_facts)
    n_names = min(len(NAMES), max(0, (body - 3 * n_facts) // 40), body - 3 * n_facts)
    names = rng.sample(NAMES, n_names)
    items: list[list[str]] = [[k, rng.choice(VALUES), "."] for k in keys] + [[n] for n in names]
    used = 3 * n_facts + n_names
    items += [[w] for w in rng.choices(FILLER, k=body - used)]
    rng.shuffle(items)
    words = ("<doc>",) + tuple(w for it in items for w in it)
    assert len(words) == n_tokens
    return Document(doc_id, words, tuple(keys), tuple(names))


def make_corpus(n_docs: int, lengths: tuple[int, int] = (128, 2048), seed: int = 0,
                first_id: int = 0) -> list[Document]:
    """`n_docs` documents with log-uniform lengths in `lengths` (tokens)."""
    rng = random.Random(seed)
    return [make_document(rng, first_id + i, log_uniform_int(rng, *lengths)) for i in range(n_docs)]


# ---- popularity and arrivals ------------------------------------------------------------------

def zipf_weights(n: int, s: float = 1.0) -> list[float]:
    """Normalised weights of ranks 1..n: w_r ∝ 1/r^s."""
    w = [1.0 / (r ** s) for r in range(1, n + 1)]
    z = sum(w)
    return [x / z for x in w]


class Popularity:
    """Zipf popularity over items: a random permutation assigns ranks (so popularity is
    independent of length); `draw(rng, k)` returns k distinct items, drawn one after the other
    with probability proportional to their weight among those left (sampling without
    replacement), in the order drawn."""

    def __init__(self, n: int, s: float = 1.0, seed: int = 0):
        self.n, self.s = n, s
        order = list(range(n))
        random.Random(seed).shuffle(order)
        self.rank_of = {item: r for r, item in enumerate(order)}   # item -> rank (0 = most popular)
        self.item_at = order                                        # rank -> item
        self.weights = zipf_weights(n, s)                           # by rank

    def weight(self, item: int) -> float:
        return self.weights[self.rank_of[item]]

    def draw(self, rng: random.Random, k: int) -> list[int]:
        k = min(k, self.n)
        # Efraimidis-Spirakis: key u^(1/w); the k largest keys are a weighted sample without
        # replacement, and sorting by key gives the order in which they would have been drawn.
        # (in logs: log(u)/w, which does not underflow for small weights)
        keyed = sorted(((math.log(1.0 - rng.random()) / w, r) for r, w in enumerate(self.weights)),
                       reverse=True)
        return [self.item_at[r] for _, r in keyed[:k]]


def poisson_arrivals(rng: random.Random, rate: float | None, n: int) -> list[float]:
    """Arrival offsets (s) of n requests: Poisson at `rate` req/s (the first after one gap), or
    all 0 when rate is None (closed loop)."""
    if rate is None:
        return [0.0] * n
    if not rate > 0:
        raise ValueError("rate must be > 0")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# ---- shapes ----------------------------------------------------------------------------------

def _within_budget(picked: Sequence[Document], max_prompt_tokens: int, query_tokens: int = 4) -> list[Document]:
    """The context budget cuts the list (in order); if every document is over it alone, the
    shortest one is kept."""
    kept, total = [], query_tokens
    for d in picked:
        if total + d.n_tokens <= max_prompt_tokens:
            kept.append(d)
            total += d.n_tokens
    return kept or [min(picked, key=lambda d: d.n_tokens)]


def _document_trace(shape: str, docs: Sequence[Document], n: int, seed: int, rate: float | None,
                    k: tuple[int, int], pop: Popularity, max_prompt_tokens: int, ask) -> list[Request]:
    """n requests of k documents drawn by popularity, in random order (the retriever's order
    differs request to request), cut to the budget; `ask(rng, kept)` writes the question."""
    rng = random.Random(seed)
    arrivals = poisson_arrivals(random.Random(seed * 7919 + 1), rate, n)
    reqs = []
    for i in range(n):
        k_drawn = rng.randint(*k)
        picked = [docs[j] for j in pop.draw(rng, k_drawn)]
        rng.shuffle(picked)
        kept = _within_budget(picked, max_prompt_tokens)
        reqs.append(Request(i, arrivals[i], [d.words for d in kept], ask(rng, kept), [d.id for d in kept],
                            k_drawn=k_drawn, shape=shape))
    return reqs


def rag_trace(corpus: Sequence[Document], n: int, seed: int, rate: float | None = None,
              k: tuple[int, int] = (4, 32), zipf_s: float = 1.0, max_prompt_tokens: int = 4096,
              popularity: Popularity | None = None, popularity_seed: int = 0) -> Trace:
    """n RAG requests over `corpus` (see the module docstring). The popularity ranks depend on
    `popularity_seed` only, so traces with different `seed`s share the same popular documents."""
    pop = popularity or Popularity(len(corpus), zipf_s, seed=popularity_seed)

    def ask(rng, kept):
        return ("<q>", "find", rng.choice(rng.choice(kept).keys), "<a>")

    reqs = _document_trace("rag", corpus, n, seed, rate, k, pop, max_prompt_tokens, ask)
    return Trace("rag", reqs, dict(seed=seed, rate=rate, k=list(k), zipf_s=zipf_s,
                                   max_prompt_tokens=max_prompt_tokens, corpus=len(corpus)))


def summarization_trace(pool: Sequence[Document], n: int, seed: int, rate: float | None = None,
                        k: tuple[int, int] = (2, 4), zipf_s: float = 1.0,
                        max_prompt_tokens: int = 4096, popularity_seed: int = 0) -> Trace:
    """Few long segments: k documents from a pool of long ones (build it with
    make_corpus(n, (768, 2048))), Zipf, random order, cut to the budget; an aggregation question."""

    def ask(rng, kept):
        names = sorted({nm for d in kept for nm in d.names}) or list(NAMES)
        return ("<q>", "count", rng.choice(names), "<a>")

    reqs = _document_trace("summarization", pool, n, seed, rate, k, Popularity(len(pool), zipf_s, seed=popularity_seed),
                           max_prompt_tokens, ask)
    return Trace("summarization", reqs, dict(seed=seed, rate=rate, k=list(k), zipf_s=zipf_s,
                                             max_prompt_tokens=max_prompt_tokens, pool=len(pool)))


def _short_segment(rng: random.Random, seg_id: int, lengths: tuple[int, int]) -> Document:
    return make_document(rng, seg_id, rng.randint(*lengths), facts_per_100=4.0)


def agent_trace(n: int, seed: int, rate: float | None = None, n_sessions: int = 4,
                tools_pool: int = 24, tools_per_session: tuple[int, int] = (6, 10),
                tool_tokens: tuple[int, int] = (32, 96), memory_pool: int = 48,
                memory_per_turn: tuple[int, int] = (2, 4), memory_tokens: tuple[int, int] = (64, 256),
                turn_tokens: tuple[int, int] = (24, 96), turn_window: int = 6, zipf_s: float = 1.0,
                pools_seed: int = 0) -> Trace:
    """Many short segments (see the module docstring). Segment ids: tools 0.., memory files
    10000.., turns 20000 + 1000·session + turn."""
    prng = random.Random(pools_seed * 104729 + 17)
    tools = [_short_segment(prng, i, tool_tokens) for i in range(tools_pool)]
    memory = [_short_segment(prng, 10000 + i, memory_tokens) for i in range(memory_pool)]
    mem_pop = Popularity(memory_pool, zipf_s, seed=pools_seed + 1)
    tool_pop = Popularity(tools_pool, zipf_s, seed=pools_seed + 2)
    rng = random.Random(seed)
    arrivals = poisson_arrivals(random.Random(seed * 7919 + 1), rate, n)
    sessions = []
    for s in range(n_sessions):
        chosen = tool_pop.draw(rng, rng.randint(*tools_per_session))
        sessions.append({"tools": [tools[j] for j in chosen], "turns": [], "id": s})
    reqs = []
    for i in range(n):
        sess = sessions[i % n_sessions] if i < n_sessions else sessions[rng.randrange(n_sessions)]
        mem = [memory[j] for j in mem_pop.draw(rng, rng.randint(*memory_per_turn))]
        rng.shuffle(mem)
        turns = sess["turns"][-turn_window:]
        segs = sess["tools"] + mem + turns
        about = rng.choice(mem)
        query = ("<q>", "find", rng.choice(about.keys), "<a>")
        reqs.append(Request(i, arrivals[i], [d.words for d in segs], query, [d.id for d in segs],
                            k_drawn=len(mem), shape="agent"))
        # this turn (the user's message and the agent's reply) becomes a segment of later turns
        t_id = 20000 + 1000 * sess["id"] + len(sess["turns"])
        sess["turns"].append(_short_segment(rng, t_id, turn_tokens))
    return Trace("agent", reqs, dict(seed=seed, rate=rate, n_sessions=n_sessions, tools_pool=tools_pool,
                                     memory_pool=memory_pool, turn_window=turn_window, zipf_s=zipf_s))


def chat_trace(n: int, seed: int, rate: float | None = None, n_sessions: int = 4,
               system_pool: int = 3, system_tokens: tuple[int, int] = (128, 384),
               turn_tokens: tuple[int, int] = (24, 128), turn_window: int = 8, zipf_s: float = 1.0,
               pools_seed: int = 0) -> Trace:
    """Multi-turn chat (see the module docstring). Segment ids: system prompts 30000..,
    turns 40000 + 1000·session + turn."""
    prng = random.Random(pools_seed * 104729 + 29)
    systems = [_short_segment(prng, 30000 + i, system_tokens) for i in range(system_pool)]
    sys_pop = Popularity(system_pool, zipf_s, seed=pools_seed + 3)
    rng = random.Random(seed)
    arrivals = poisson_arrivals(random.Random(seed * 7919 + 1), rate, n)
    sessions = [{"system": systems[sys_pop.draw(rng, 1)[0]], "turns": [], "id": s} for s in range(n_sessions)]
    reqs = []
    for i in range(n):
        sess = sessions[i % n_sessions] if i < n_sessions else sessions[rng.randrange(n_sessions)]
        segs = [sess["system"]] + sess["turns"][-turn_window:]
        # the user asks about something said before (or in the system prompt on the first turn)
        about = rng.choice(segs)
        query = ("<q>", "find", rng.choice(about.keys), "<a>")
        reqs.append(Request(i, arrivals[i], [d.words for d in segs], query, [d.id for d in segs],
                            k_drawn=len(segs) - 1, shape="chat"))
        t_id = 40000 + 1000 * sess["id"] + len(sess["turns"])
        sess["turns"].append(_short_segment(rng, t_id, turn_tokens))
    return Trace("chat", reqs, dict(seed=seed, rate=rate, n_sessions=n_sessions, system_pool=system_pool,
                                    turn_window=turn_window, zipf_s=zipf_s))


def fewshot_trace(n: int, seed: int, rate: float | None = None, n_tasks: int = 3,
                  instruction_tokens: tuple[int, int] = (48, 128), examples_pool: int = 32,
                  k: tuple[int, int] = (4, 12), example_tokens: tuple[int, int] = (48, 160),
                  zipf_s: float = 1.0, pools_seed: int = 0) -> Trace:
    """Few-shot in-context learning (see the module docstring). Segment ids: instructions
    50000 + task, examples 60000 + 1000·task + example."""
    prng = random.Random(pools_seed * 104729 + 43)
    instructions = [_short_segment(prng, 50000 + t, instruction_tokens) for t in range(n_tasks)]
    pools = [[_short_segment(prng, 60000 + 1000 * t + j, example_tokens) for j in range(examples_pool)]
             for t in range(n_tasks)]
    task_pop = Popularity(n_tasks, zipf_s, seed=pools_seed + 4)
    ex_pops = [Popularity(examples_pool, zipf_s, seed=pools_seed + 10 + t) for t in range(n_tasks)]
    rng = random.Random(seed)
    arrivals = poisson_arrivals(random.Random(seed * 7919 + 1), rate, n)
    reqs = []
    for i in range(n):
        t = task_pop.draw(rng, 1)[0]
        k_drawn = rng.randint(*k)
        shots = [pools[t][j] for j in ex_pops[t].draw(rng, k_drawn)]
        rng.shuffle(shots)
        segs = [instructions[t]] + shots
        query = ("<q>", "find", rng.choice(rng.choice(shots).keys), "<a>")
        reqs.append(Request(i, arrivals[i], [d.words for d in segs], query, [d.id for d in segs],
                            k_drawn=k_drawn, shape="fewshot"))
    return Trace("fewshot", reqs, dict(seed=seed, rate=rate, n_tasks=n_tasks, examples_pool=examples_pool,
                                       k=list(k), zipf_s=zipf_s))


def with_arrivals(trace: Trace, rate: float | None, seed: int) -> Trace:
    """The same requests with new arrival times (Poisson at `rate`, or closed loop)."""
    arr = poisson_arrivals(random.Random(seed), rate, len(trace.requests))
    reqs = [Request(r.index, a, r.segments, r.query, r.doc_ids, r.k_drawn, r.shape, r.max_tokens)
            for r, a in zip(trace.requests, arr)]
    return Trace(trace.shape, reqs, {**trace.params, "rate": rate})


# ---- skewed segment lengths (cold path) --------------------------------------------------------

def skewed_lengths(total_tokens: int, seed: int, lo: int = 128, hi: int = 4096,
                   heavy: Sequence[int] = ()) -> list[int]:
    """Segment lengths summing to exactly `total_tokens`: `heavy` long segments first, then
    log-uniform ones in [lo, hi] until the total is reached (the last one is cut, and merged into
    its predecessor if that leaves it under lo), in random order."""
    rng = random.Random(seed)
    out = list(heavy)
    left = total_tokens - sum(out)
    if left < 0:
        raise ValueError("heavy segments exceed the total")
    while left > 0:
        n = min(log_uniform_int(rng, lo, hi), left)
        if n < lo and out:
            out[-1] += n
        else:
            out.append(n)
        left -= n
    rng.shuffle(out)
    return out


def to_ids(words: Sequence[str], vocab: dict[str, int] | None, vocab_size: int) -> list[int]:
    """Token ids of `words`: the tokenizer's vocabulary when given, else a fixed map of the
    language's words into [6, vocab_size) (for random checkpoints without a tokenizer)."""
    if vocab is not None:
        unk = vocab.get("<unk>", 1)
        return [vocab.get(w, unk) for w in words]
    index = _WORD_INDEX
    span = max(1, vocab_size - 6)
    return [6 + index[w] % span for w in words]


_WORD_INDEX = {w: i for i, w in enumerate(T.WORDS)}
