"""common.mesh.tokenizer: the router's `tokenizers` fast path and the front's direct generic class
give the ids, text and chat renderings transformers' AutoTokenizer gives (their reference) on
random input, are refused for the directories where AutoTokenizer would load something else, and
keep torch out of the router and the front (transformers too, for the router)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hypic.launcher import DEFAULT_MODEL
from common.mesh.tokenizer import (OVERRIDDEN_MODEL_TYPES, FastTokenizer, fast_path_refusal,
                                   load_tokenizer, load_transformers_tokenizer)
from services.router.model import Detokenizer
from tests.support.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (the bundled model's is a word-level one)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def random_texts(vocab: list[str], rng: random.Random, n: int) -> list[str]:
    """Vocabulary words, special tokens written out, unknown words, unicode and odd spacing."""
    extra = ["", " ", "  \t\n", "ünïcødé", "日本語", "emoji 🙂", "<eos><doc>", "x<|endoftext|>y"]
    out = []
    for _ in range(n):
        words = [rng.choice(vocab + extra) for _ in range(rng.randint(0, 30))]
        out.append("".join(w + rng.choice([" ", "", "  ", "\n"]) for w in words))
    return out


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_fast_path_matches_transformers_on_random_text_and_ids(which, tiny_model) -> None:
    from transformers import AutoTokenizer

    model = DEFAULT_MODEL if which == "bundled" else tiny_model
    assert fast_path_refusal(model) is None
    fast, reference = load_tokenizer(model), AutoTokenizer.from_pretrained(str(model))
    assert isinstance(fast, FastTokenizer)
    assert fast.eos_token_id == reference.eos_token_id
    assert fast.model_max_length == reference.model_max_length
    rng = random.Random(29)
    vocab = list(reference.get_vocab())
    texts = random_texts(vocab, rng, 200)
    assert fast(texts, add_special_tokens=False)["input_ids"] == \
        reference(texts, add_special_tokens=False)["input_ids"]
    size = len(reference)
    for _ in range(200):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 40))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        # the router's incremental detokenizer streams the same pieces either way
        fast_detok, ref_detok = Detokenizer(fast), Detokenizer(reference)
        assert [fast_detok.push(t) for t in ids] == [ref_detok.push(t) for t in ids]
        assert fast_detok.flush() == ref_detok.flush()


def _copy_tokenizer(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                           if v is not None}))
    return dst


def test_refused_where_transformers_would_change_the_tokenizer(tmp_path) -> None:
    cases = {"class": {"tokenizer_class": "Qwen2Tokenizer"},
             "added": {"added_tokens_decoder": {"349": {"content": "<new>", "special": True}}},
             "bos": {"add_bos_token": True},
             "foreign special": {"eos_token": "<not-added>"}}
    for name, change in cases.items():
        model = _copy_tokenizer(DEFAULT_MODEL, tmp_path / name.replace(" ", "_"), **change)
        assert fast_path_refusal(model) is not None, name
    overridden = _copy_tokenizer(DEFAULT_MODEL, tmp_path / "qwen2")
    (overridden / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "model type 'qwen2'" in fast_path_refusal(overridden)
    mistral = _copy_tokenizer(DEFAULT_MODEL, tmp_path / "mistral")
    (mistral / "tekken.json").write_text("{}")
    assert "Mistral" in fast_path_refusal(mistral)
    truncating = _copy_tokenizer(DEFAULT_MODEL, tmp_path / "truncation")
    raw = json.loads((truncating / "tokenizer.json").read_text())
    raw["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                         "stride": 0}
    (truncating / "tokenizer.json").write_text(json.dumps(raw))
    assert "truncation" in fast_path_refusal(truncating)
    assert fast_path_refusal(tmp_path / "class").startswith("tokenizer class")
    # refused: transformers loads it (a class transformers knows, so it loads)
    model = _copy_tokenizer(DEFAULT_MODEL, tmp_path / "known", add_bos_token=False)
    assert not isinstance(load_tokenizer(model), FastTokenizer)


def test_overridden_model_types_cover_transformers_list() -> None:
    """A transformers upgrade that overrides one more model type's declared class fails here."""
    from transformers.models.auto import tokenization_auto

    assert set(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) <= OVERRIDDEN_MODEL_TYPES


def random_messages(vocab: list[str], rng: random.Random, n: int) -> list[dict]:
    roles = ["system", "developer", "user", "assistant", "tool"]
    return [{"role": rng.choice(roles), "content": text} for text in random_texts(vocab, rng, n)]


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_front_tokenizer_is_autotokenizers_own(which, tiny_model) -> None:
    from transformers import AutoTokenizer

    model = DEFAULT_MODEL if which == "bundled" else tiny_model
    direct, reference = load_transformers_tokenizer(model), AutoTokenizer.from_pretrained(str(model))
    assert type(direct) is type(reference)
    assert direct.special_tokens_map == reference.special_tokens_map
    assert direct.chat_template == reference.chat_template
    assert direct.eos_token_id == reference.eos_token_id
    rng = random.Random(30)
    vocab = list(reference.get_vocab())
    texts = random_texts(vocab, rng, 100)
    assert direct(texts, add_special_tokens=False)["input_ids"] == \
        reference(texts, add_special_tokens=False)["input_ids"]
    if reference.chat_template:
        for message in random_messages(vocab, rng, 100):
            for query in (True, False):
                assert direct.apply_chat_template([message], tokenize=False, add_generation_prompt=query) \
                    == reference.apply_chat_template([message], tokenize=False, add_generation_prompt=query)


PROBES = {
    "router": "from services.router.__main__ import RouterService; "
              "from services.router.model import ModelInfo; "
              "assert ModelInfo.load(MODEL).encode_batch(['vufar lopo'])",
    "front": "from services.front.app import create_app; "
             "from services.front.segments import ChatTemplate; "
             "assert ChatTemplate.load(MODEL).render('user', 'vufar', query=True)",
}


@pytest.mark.processes
@pytest.mark.parametrize("service", sorted(PROBES))
def test_router_and_front_load_the_bundled_tokenizer_without_torch(service) -> None:
    probe = (f"import sys; MODEL = {str(DEFAULT_MODEL)!r}; {PROBES[service]}; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    # the front renders the chat template with services/front/chat_render.py (issue 29)
    assert out.stdout.strip() == "[]"
