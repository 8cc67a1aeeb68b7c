"""The quality tasks: a small closed language of documents, facts and questions, with a fixed seed.

A prompt is a list of documents (one segment each, every one starting with `<doc>`) and a query
segment `<q> TASK ARG <a>` whose answer is one token:

    <doc> the of dorap mibo . and Maro with ... kelut soba . ...        (a document)
    <q> find dorap <a>   -> mibo                 retrieval: the value stated for a key
    <q> chain kelut <a>  -> dorap mibo           two-hop: kelut's value is another key (dorap),
                                                 whose own value (mibo) is stated in another
                                                 document; the answer spells the bridge key, then
                                                 the value (both must be right)
    <q> count Maro <a>   -> 3                    aggregation: how many documents mention a name
    <q> find dorap <a>   -> lesa                 update: dorap was stated in several documents with
                                                 different values; the answer is the last one (the
                                                 documents are read in order, later ones revise
                                                 earlier ones, as in a log or a versioned record)
    <q> find dorap <a>   -> mibo                 span: the fact spans a document boundary: one
                                                 document ends with the key (`... soba . dorap`),
                                                 the next begins mid-sentence with its value
                                                 (`<doc> is then mibo . and ...`); only a model
                                                 that reads each document's opening in the context
                                                 of the previous one can pair them (several
                                                 boundaries of the prompt carry such a fact, so
                                                 "the value that opens some document" is right
                                                 only by chance)

Facts are `KEY VALUE .` with single-token keys. Outside the update task a key is stated once per
prompt; an updated key is restated with a new value in 1-2 later documents (`facts` holds the
value of its last statement). A two-hop chain is a fact `K1 K2 .` in one document and `K2 V .` in
another. Names are single tokens scattered in the
filler, at most once per document, mentioned by 0-4 documents. Answers are one token (retrieval,
aggregation) or two (two-hop: the bridge key, then its value, decoded one after the other).

Training prompts carry many queries after the documents (dense supervision: the loss is on every
answer token); evaluation prompts carry one. All randomness comes from `random.Random` seeded
from integers, so a (seed, index) pair always gives the same prompt.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

# -- the language ------------------------------------------------------------------------------
SPECIALS = ["<pad>", "<unk>", "<doc>", "<q>", "<a>", "<eos>"]

# The chat template saved with the tokenizer (what the OpenAI front applies to each message alone):
# a document segment is "<doc> text", the query (the last user message) "<q> text <a>".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] | trim -%}"
    "{%- if loop.last and add_generation_prompt and message['role'] == 'user' -%}"
    "{{- content if content.startswith('<q>') else '<q> ' + content + ' <a>' -}}"
    "{%- else -%}"
    "{{- content if content.startswith('<doc>') else '<doc> ' + content -}}"
    "{%- endif -%}"
    "{%- if not loop.last %} {% endif -%}"
    "{%- endfor -%}")
# the update task asks with retrieval's word: "find" always means the key's current (last) value
# (so do span queries: a fact split over two documents is still a fact)
TASK_WORDS = {"retrieval": "find", "two_hop": "chain", "aggregation": "count", "update": "find", "span": "find"}
TASKS = tuple(TASK_WORDS)
PUNCT = ["."]
DIGITS = [str(i) for i in range(10)]
FILLER = (
    "the of and to in is was for on with as by at from that this it be are or an were which "
    "has had not but have its also been one their they more after first other new some into "
    "two all there who would over time when most only up about many out then can her may these "
    "such so than him could year three while where later well before between both under during "
    "since made used part people known each city world would any same very should number small "
    "like long area still those around however through several house began high around west east"
).split()
N_KEYS, N_VALUES, N_NAMES = 128, 64, 32
MAX_COUNT = 4  # aggregation answers are 0 .. MAX_COUNT

_CONS = "bdfgklmnprstvz"
_VOW = "aeiou"


def _pseudo_words(rng: random.Random, n: int, syllables: int, taken: set[str], final: str = "") -> list[str]:
    out = []
    while len(out) < n:
        w = "".join(rng.choice(_CONS) + rng.choice(_VOW) for _ in range(syllables))
        if final:
            w += rng.choice(final)
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def _build_language():
    rng = random.Random(20261108)
    filler = list(dict.fromkeys(FILLER))
    taken = set(filler) | set(TASK_WORDS.values())
    keys = _pseudo_words(rng, N_KEYS, 2, taken, final="lnrst")
    values = _pseudo_words(rng, N_VALUES, 2, taken)
    names = [w.capitalize() for w in _pseudo_words(rng, N_NAMES, 2, taken, final="mn")]
    return filler, keys, values, names


FILLER_WORDS, KEYS, VALUES, NAMES = _build_language()
WORDS = SPECIALS + list(dict.fromkeys(TASK_WORDS.values())) + PUNCT + DIGITS + FILLER_WORDS + KEYS + VALUES + NAMES


# -- prompts -----------------------------------------------------------------------------------
@dataclass
class Query:
    task: str
    words: list[str]  # the query segment, e.g. ["<q>", "find", "dorap", "<a>"]
    answer: list[str]  # answer words, one token each (two-hop: bridge key, value)


@dataclass
class World:
    """One set of documents and what can be asked about them."""

    docs: list[list[str]]  # each starts with "<doc>"
    facts: dict[str, str]  # key -> value (a value word, or a key word for a chain head)
    fact_doc: dict[str, int]  # key -> index of the document stating it
    chains: list[tuple[str, str, str]]  # (k1, k2, value): k1 -> k2 in one doc, k2 -> value in another
    name_counts: dict[str, int]  # name -> number of documents mentioning it (absent names: 0)
    history: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # updated key -> [(doc, value)]
    spans: dict[str, int] = field(default_factory=dict)  # key -> the document it ends (its value opens the next)
    queries: list[Query] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(d) for d in self.docs)


def make_world(rng: random.Random, n_docs: int, filler: tuple[int, int], facts: tuple[int, int] = (2, 4),
               mentions: tuple[int, int] = (1, 3), chains: bool = True, updates: tuple[int, int] = (0, 0),
               spans: tuple[int, int] = (0, 0), span_decoys: bool = False) -> World:
    """`n_docs` documents with `facts` facts, `mentions` name mentions and `filler` filler words each
    (and two-hop chains between documents unless chains=False); `updates` keys (not chain keys)
    are restated with new values in 1-2 later documents; `spans` document boundaries carry a fact
    split over them (add_spans), and with `span_decoys` every other boundary opens the same way
    without a key before it (add_span_decoys). With updates=(0, 0) and spans=(0, 0) no random number
    is drawn for them, so the prompts of the other tasks are those of the generator without them."""
    n_facts = [rng.randint(*facts) for _ in range(n_docs)]
    keys = rng.sample(KEYS, sum(n_facts))
    fact_doc: dict[str, int] = {}
    it = iter(keys)
    per_doc: list[list[str]] = []
    for d, n in enumerate(n_facts):
        ks = [next(it) for _ in range(n)]
        per_doc.append(ks)
        for k in ks:
            fact_doc[k] = d
    facts_map = {k: rng.choice(VALUES) for k in keys}
    # two-hop chains: a head fact's value becomes the key of a fact in another document
    chain_list: list[tuple[str, str, str]] = []
    if chains and n_docs >= 2:
        order = keys[:]
        rng.shuffle(order)
        used: set[str] = set()
        want = max(1, len(keys) // 3)
        for k1 in order:
            if len(chain_list) >= want:
                break
            if k1 in used:
                continue
            cands = [k for k in order if k not in used and k != k1 and fact_doc[k] != fact_doc[k1]]
            if not cands:
                continue
            k2 = rng.choice(cands)
            used.update((k1, k2))
            facts_map[k1] = k2
            chain_list.append((k1, k2, facts_map[k2]))
    # updates: a key of an earlier document restated, with a value it has not had, in later ones
    restated: list[list[list[str]]] = [[] for _ in range(n_docs)]
    history: dict[str, list[tuple[int, str]]] = {}
    if updates[1] > 0 and n_docs >= 2:
        in_chain = {k for c in chain_list for k in c[:2]}
        pool = [k for k in keys if k not in in_chain and fact_doc[k] < n_docs - 1]
        for k in rng.sample(pool, min(len(pool), rng.randint(*updates))):
            later = list(range(fact_doc[k] + 1, n_docs))
            hist = [(fact_doc[k], facts_map[k])]
            for d in sorted(rng.sample(later, min(len(later), rng.randint(1, 2)))):
                v = rng.choice([v for v in VALUES if v not in {h[1] for h in hist}])
                hist.append((d, v))
                restated[d].append([k, v, "."])
            facts_map[k] = hist[-1][1]
            history[k] = hist
    # names: each mentioned by 1..MAX_COUNT documents, at most once per document
    slots = [rng.randint(*mentions) for _ in range(n_docs)]
    names = rng.sample(NAMES, len(NAMES))
    doc_names: list[list[str]] = [[] for _ in range(n_docs)]
    name_counts: dict[str, int] = {}
    for name in names:
        free = [d for d in range(n_docs) if len(doc_names[d]) < slots[d]]
        if not free:
            break
        c = min(rng.randint(1, MAX_COUNT), len(free))
        for d in rng.sample(free, c):
            doc_names[d].append(name)
        name_counts[name] = c
    docs = []
    for d in range(n_docs):
        items: list[list[str]] = [[k, history[k][0][1] if k in history else facts_map[k], "."] for k in per_doc[d]]
        items += restated[d] + [[n] for n in doc_names[d]]
        items += [[w] for w in rng.choices(FILLER_WORDS, k=rng.randint(*filler))]
        # keep the items of a fact together; shuffle everything else around them
        rng.shuffle(items)
        docs.append(["<doc>"] + [w for item in items for w in item])
    world = World(docs, facts_map, fact_doc, chain_list, name_counts, history)
    if spans[1] > 0 and n_docs >= 2:
        add_spans(rng, world, rng.randint(*spans))
        if span_decoys:
            add_span_decoys(rng, world)
    return world


# What a span fact's second document opens with before the value. The value is then 4 tokens after
# the key, beyond the reach of the short causal convolution (kernel 4) of the linear layers: hypic
# composes every linear state exactly, conv included, also without seams, so a key-value pair the
# convolution can bridge (`KEY | <doc> VALUE`) is recalled from the composed states at w = 0 as well
# as in full recompute (measured after a 100-step fine-tune on that variant, 40 prompts: w=0 80%,
# w=8 82.5%, full 82.5%). At this distance no single convolution window holds both, so (by the
# architecture; not yet shown on a trained model) only attention from the opening tokens to the
# previous document pairs them: what a seam of w >= 4 recomputes and w = 0 does not.
SPAN_OPENING = ["is", "then"]


def add_spans(rng: random.Random, world: World, n: int) -> None:
    """Split a new fact over each of `n` random document boundaries: document d ends with the key,
    document d + 1 opens with SPAN_OPENING, the value and the full stop (`<doc> is then VALUE .`).
    The keys are ones the world does not use yet, so the span fact is the key's only statement."""
    boundaries = rng.sample(range(len(world.docs) - 1), min(n, len(world.docs) - 1))
    free = [k for k in KEYS if k not in world.facts and k not in world.facts.values()]
    for d, key in zip(sorted(boundaries), rng.sample(free, len(boundaries))):
        value = rng.choice(VALUES)
        world.docs[d].append(key)
        world.docs[d + 1][1:1] = SPAN_OPENING + [value, "."]
        world.facts[key] = value
        world.fact_doc[key] = d
        world.spans[key] = d


def add_span_decoys(rng: random.Random, world: World) -> None:
    """Open every document after a boundary that carries no split fact with SPAN_OPENING, a value
    and a full stop too, with no key before it (training only). Without them the values opening
    documents are exactly the span answers, and a training prompt's many span queries can be
    answered by elimination among them (measured: 70% span accuracy on training batches, 25-32% on
    held-out one-query prompts after 450 steps); with them each answer must be paired with its key."""
    spanned = set(world.spans.values())
    for d in range(len(world.docs) - 1):
        if d not in spanned:
            world.docs[d + 1][1:1] = SPAN_OPENING + [rng.choice(VALUES), "."]


def make_query(rng: random.Random, world: World, task: str, train: bool = False) -> Query:
    w = TASK_WORDS[task]
    if task == "retrieval":
        heads = {c[0] for c in world.chains}
        pool = list(world.facts) if train else [k for k in world.facts if k not in heads and k not in world.history
                                                and k not in world.spans]
        k = rng.choice(pool)
        return Query(task, ["<q>", w, k, "<a>"], [world.facts[k]])
    if task == "update":
        if not world.history:  # a small training world may have no key to restate (all in chains)
            if train:
                return make_query(rng, world, "retrieval", train=True)
            raise ValueError("an update query needs a world with restated keys")
        k = rng.choice(sorted(world.history))
        return Query(task, ["<q>", w, k, "<a>"], [world.facts[k]])
    if task == "span":
        if not world.spans:
            if train:
                return make_query(rng, world, "retrieval", train=True)
            raise ValueError("a span query needs a world with facts split over document boundaries")
        k = rng.choice(sorted(world.spans))
        return Query(task, ["<q>", w, k, "<a>"], [world.facts[k]])
    if task == "two_hop":
        k1, k2, v = rng.choice(world.chains)
        return Query(task, ["<q>", w, k1, "<a>"], [k2, v])
    if task == "aggregation":
        c = rng.randint(0, MAX_COUNT)
        with_c = [n for n, m in world.name_counts.items() if m == c]
        if c == 0 or not with_c:
            absent = [n for n in NAMES if n not in world.name_counts]
            if c == 0 and absent:
                return Query(task, ["<q>", w, rng.choice(absent), "<a>"], ["0"])
            n = rng.choice(list(world.name_counts))
            return Query(task, ["<q>", w, n, "<a>"], [str(world.name_counts[n])])
        n = rng.choice(with_c)
        return Query(task, ["<q>", w, n, "<a>"], [str(c)])
    raise ValueError(f"unknown task {task!r}")


# -- evaluation prompts --------------------------------------------------------------------------
EVAL_SEED = 7_000_003
EVAL_DOCS = 8
EVAL_FILLER = (34, 54)  # words per document: 8 documents, ~450 tokens in all
EVAL_UPDATES = (1, 3)  # keys restated in the update task's prompts (one of them is asked)
# boundaries (of 7) carrying a split fact in the span task's prompts: with 4-7 of them, a model
# that answers with the value opening some document (what it sees without the previous one) is
# right ~1 time in 5
EVAL_SPANS = (4, 7)


def eval_prompt(task: str, index: int, seed: int = EVAL_SEED, n_docs: int = EVAL_DOCS,
                filler: tuple[int, int] = EVAL_FILLER) -> tuple[World, Query]:
    """Held-out prompt `index` of `task` (its own seed stream, disjoint from training)."""
    rng = random.Random(seed * 1_000_003 + TASKS.index(task) * 100_003 + index)
    world = make_world(rng, n_docs, filler, updates=EVAL_UPDATES if task == "update" else (0, 0),
                       spans=EVAL_SPANS if task == "span" else (0, 0))
    return world, make_query(rng, world, task)


# -- training batches ----------------------------------------------------------------------------
@dataclass
class Curriculum:
    """Levels of (documents, filler words per document), easiest first; the last one covers the
    evaluation prompts (8 documents, 34-54 filler words). Training moves up a level when the model
    answers the retrieval queries of the current one (see bench.quality.train), and is forced up
    on a fixed schedule from `force_from` of the run so that the last level is reached by `force_by`
    in any case."""

    levels: tuple = (
        ((2, 3), (0, 5)),
        ((2, 4), (0, 12)),
        ((3, 6), (5, 20)),
        ((4, 8), (10, 32)),
        ((5, 10), (20, 45)),
        ((6, 12), (25, 54)),
    )
    # level 0 asks retrieval only, its documents have no two-hop chains (a chain's bridge key is
    # stated twice) and no names: associative recall is learned in a jump, which with the other
    # tasks mixed in from the start had not come after 600 steps (plain retrieval alone: ~270)
    mixes: tuple = ({"retrieval": 1.0, "two_hop": 0.0, "aggregation": 0.0},)
    force_from: float = 0.6
    force_by: float = 0.85

    def level(self, adaptive: int, frac: float) -> int:
        forced = int(len(self.levels) * min(1.0, max(0.0, frac - self.force_from) / (self.force_by - self.force_from)))
        return min(len(self.levels) - 1, max(adaptive, forced))

    def sample(self, rng: random.Random, level: int) -> tuple[int, tuple[int, int]]:
        (k_lo, k_hi), filler = self.levels[level]
        return rng.randint(k_lo, k_hi), filler

    def mix(self, level: int) -> dict[str, float]:
        return self.mixes[level] if level < len(self.mixes) else TRAIN_MIX


TRAIN_MIX = {"retrieval": 0.34, "two_hop": 0.33, "aggregation": 0.33}


def train_sequence(rng: random.Random, n_docs: int, filler: tuple[int, int], n_queries: tuple[int, int] = (24, 32),
                   mix: dict[str, float] = TRAIN_MIX) -> tuple[list[str], list[tuple[int, str, str]]]:
    """Documents then many queries; returns the words and, for every answer token, (position
    whose next-token prediction is that token, answer word, task). A query is not repeated while
    unasked ones of its task remain (a repeat could be answered by copying the earlier answer)."""
    simple = all(mix.get(t, 0) == 0 for t in TASKS if t != "retrieval")
    # retrieval alone (the first curriculum level): no chains, no names, queries drawn with
    # replacement -- the plain associative-recall setting in which the jump came soonest.
    # Restated keys only when update queries are in the mix (so that earlier mixes' batches stay
    # what they were); retrieval queries may then ask for a restated key too, with its last value.
    upd = (2, 6) if mix.get("update", 0) > 0 else (0, 0)
    spans = (2, 7) if mix.get("span", 0) > 0 else (0, 0)  # likewise split facts only with span queries
    world = make_world(rng, n_docs, filler, mentions=(0, 0) if simple else (1, 3), chains=not simple, updates=upd,
                       spans=spans, span_decoys=spans[1] > 0)
    # with span queries in the mix a repeated query is dropped, not asked again: its answer could be
    # copied from the earlier one, and span answers are few enough to be learned that way instead
    no_repeats = spans[1] > 0
    words = [w for d in world.docs for w in d]
    targets = []
    tasks, weights = zip(*mix.items())
    seen: set[tuple[str, ...]] = set()
    for _ in range(rng.randint(*n_queries)):
        task = rng.choices(tasks, weights)[0]
        for _attempt in range(1 if simple else 8):
            q = make_query(rng, world, task, train=True)
            if tuple(q.words) not in seen:
                break
        else:
            if no_repeats:
                continue
        seen.add(tuple(q.words))
        words += q.words
        for a in q.answer:
            targets.append((len(words) - 1, a, q.task))
            words.append(a)
    return words, targets


# -- tokenizer -------------------------------------------------------------------------------------
def corpus(n: int = 3000, seed: int = 1):
    rng = random.Random(seed)
    for _ in range(n):
        words, _ = train_sequence(rng, rng.randint(2, 16), (10, 50))
        yield " ".join(words)


def train_tokenizer(out_dir: Path | str):
    """A WordLevel tokenizer trained with `tokenizers` on generated text, saved so that
    `AutoTokenizer.from_pretrained(out_dir)` loads it."""
    # lazily: every benchmark imports this module (through bench.workloads); only training needs these
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.WordLevel(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(min_frequency=1, show_progress=False)
    trained.train_from_iterator(list(corpus()) + [" ".join(WORDS)], trainer=trainer)
    # ids: the special tokens first (0..5, fixed), then the trained vocabulary in its own
    # (frequency) order, renumbered contiguously
    learned = [w for w, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]) if w not in SPECIALS]
    vocab = {w: i for i, w in enumerate(SPECIALS + learned)}
    missing = [w for w in WORDS if w not in vocab]
    if missing or len(vocab) != len(WORDS):
        raise RuntimeError(f"tokenizer vocabulary does not match the language: missing {missing[:5]}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", bos_token="<doc>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def word_ids(tokenizer) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {w: vocab[w] for w in WORDS}
