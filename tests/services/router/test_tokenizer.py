"""services.router.tokenizer: the `tokenizers` fast path gives the ids and text transformers'
AutoTokenizer gives (its reference) on random text and ids, refuses the directories where
transformers would change the tokenizer, and keeps torch and transformers out of the router."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hypic.launcher import DEFAULT_MODEL
from services.router.model import Detokenizer, ModelInfo
from services.router.tokenizer import FastTokenizer, fast_path_refusal, load_tokenizer
from tests.support.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]


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


@pytest.mark.processes
def test_the_router_loads_its_model_without_torch_or_transformers() -> None:
    probe = ("import sys; from services.router.__main__ import RouterService; "
             "from services.router.model import ModelInfo; "
             f"info = ModelInfo.load({str(DEFAULT_MODEL)!r}); "
             "assert info.encode_batch(['vufar lopo']); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
