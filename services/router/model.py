"""What the router knows about the model without loading its weights: type, vocabulary size,
fingerprint (common.engine.fingerprint) and tokenizer (common.mesh.tokenizer: the `tokenizers`
library on tokenizer.json where that gives what transformers would, else transformers.AutoTokenizer;
when the model directory has tokenizer files)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from common.engine.fingerprint import model_fingerprint
from common.mesh.tokenizer import NO_TOKENIZER_LIMIT, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelError(ValueError):
    """The model directory cannot be served (missing config, no vocabulary size...)."""


def read_model_config(path: Path) -> tuple[str, int, dict]:
    """(model_type, vocab_size, raw config) from config.json; the vocabulary of multimodal
    configs lives in their text sub-config."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise ModelError(f"no config.json in {path}")
    raw = json.loads(cfg_path.read_text())
    model_type = str(raw.get("model_type", ""))
    vocab = raw.get("vocab_size")
    if not vocab:
        for sub in ("text_config", "language_config", "llm_config"):
            if isinstance(raw.get(sub), dict) and raw[sub].get("vocab_size"):
                vocab = raw[sub]["vocab_size"]
                break
    if not vocab or int(vocab) <= 0:
        raise ModelError(f"{cfg_path}: no vocab_size")
    return model_type, int(vocab), raw


# Keys that record the trained context length: Hugging Face configs, top level or in the text
# sub-config of a multimodal one (the smallest found applies).
LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def model_max_len(raw_config: dict, tokenizer: Any = None) -> int | None:
    """The longest prompt the model takes: the smallest of what its config records
    (max_position_embeddings ..., also in a text sub-config) and the tokenizer's
    model_max_length; None when neither says."""
    found = []
    for cfg in [raw_config] + [raw_config[s] for s in ("text_config", "language_config",
                                                        "llm_config")
                               if isinstance(raw_config.get(s), dict)]:
        found += [int(cfg[k]) for k in LENGTH_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0]
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < NO_TOKENIZER_LIMIT // 2:
        found.append(tok_limit)
    return min(found) if found else None


@dataclass
class ModelInfo:
    path: Path
    model_type: str
    vocab_size: int
    fingerprint: str
    tokenizer: Any = None  # a FastTokenizer or transformers tokenizer, or None (token ids only)
    # The longest prompt the model takes (model_max_len); None when nothing in the directory says.
    max_model_len: int | None = None

    @classmethod
    def load(cls, path: str | Path, *, tokenizer: bool = True) -> "ModelInfo":
        path = Path(path)
        model_type, vocab, raw = read_model_config(path)
        tok = None
        if tokenizer and any((path / f).exists() for f in TOKENIZER_FILES):
            tok = load_tokenizer(path)
        limit = model_max_len(raw, tok)
        if tok is not None:
            # The router checks prompt lengths itself (a clean INVALID_ARGUMENT); without this
            # transformers logs "will result in indexing errors" for every long text it encodes.
            tok.model_max_length = NO_TOKENIZER_LIMIT
        return cls(path, model_type, vocab, model_fingerprint(path), tok, limit)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text alone, without special tokens (segments are prompt pieces)."""
        if self.tokenizer is None:
            raise ModelError("the model has no tokenizer: send token ids")
        if not texts:
            return []
        out = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [list(map(int, ids)) for ids in out]

    def detokenizer(self) -> "Detokenizer | None":
        return Detokenizer(self.tokenizer) if self.tokenizer is not None else None


class Detokenizer:
    """Incremental detokenization: text pieces that concatenate to decode(all ids), holding back
    an incomplete UTF-8 character until the token that completes it arrives."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0   # start of the window decoded for context
        self.read = 0     # ids up to here have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the stream)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
