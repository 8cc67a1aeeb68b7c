"""The router's tokenizer: the model's tokenizer.json run by the `tokenizers` library itself when
transformers would run it unchanged, else transformers.AutoTokenizer.

Why: AutoTokenizer first imports transformers' model-config machinery and with it torch, about
4.5 s of CPU in a process that needs neither (the router was the mesh's slowest start after the
model workers). The `tokenizers` library is what transformers' generic tokenizer class
(TokenizersBackend, formerly PreTrainedTokenizerFast) calls for every encode and decode; the fast
path is taken only when that class would not change the loaded tokenizer (`fast_path_refusal`), so
the token ids and text are the same (tests/services/router/test_tokenizer.py holds the two
together on random text and ids). Model-specific tokenizer classes, added tokens declared only in
tokenizer_config.json, and the like keep transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

# What transformers writes as model_max_length when a tokenizer has no limit (int(1e30)).
NO_TOKENIZER_LIMIT = int(1e30)
# tokenizer_config.json's classes that load tokenizer.json as it is (v5's name and its v4 alias).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")
# tokenizer_config.json keys that change nothing the router does (encode without special tokens,
# decode skipping them): any other key (added_tokens_decoder, extra_special_tokens,
# split_special_tokens, add_bos_token, add_prefix_space...) may, so it keeps transformers.
INERT_KEYS = frozenset(SPECIAL_TOKEN_KEYS) | {
    "backend", "tokenizer_class", "model_max_length", "chat_template", "is_local",
    "local_files_only", "clean_up_tokenization_spaces", "model_input_names", "padding_side",
    "truncation_side", "name_or_path"}
# transformers patches the pre-tokenizer of some tokenizers this large (Mistral's regex).
MAX_FAST_VOCAB = 100_000


def fast_path_refusal(model_dir: Path) -> str | None:
    """Why transformers must load this directory's tokenizer (None: `FastTokenizer` gives the
    same ids and text)."""
    tok_file, cfg_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tok_file.is_file() or not cfg_file.is_file():
        return "no tokenizer.json and tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer class {cfg.get('tokenizer_class')!r}"
    other = sorted(set(cfg) - INERT_KEYS)
    if other:
        return f"tokenizer_config.json sets {', '.join(other)}"
    raw = json.loads(tok_file.read_text())
    if raw.get("truncation") is not None or raw.get("padding") is not None:
        return "tokenizer.json sets truncation or padding"
    special = {t.get("content") for t in raw.get("added_tokens", []) if t.get("special")}
    named = [cfg[k] for k in SPECIAL_TOKEN_KEYS if cfg.get(k) is not None]
    if not all(isinstance(t, str) and t in special for t in named):
        return "a special token of tokenizer_config.json is not one of tokenizer.json's"
    return None


class FastTokenizer:
    """tokenizer.json through `tokenizers`, with the slice of transformers' tokenizer interface
    the router uses: __call__(texts, add_special_tokens=False)["input_ids"], decode(ids, ...),
    model_max_length, eos_token_id."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.backend.no_truncation()  # as transformers' call without truncation / padding
        self.backend.no_padding()
        self.backend.encode_special_tokens = False  # transformers' split_special_tokens=False
        limit = cfg.get("model_max_length")
        self.model_max_length = int(limit) if isinstance(limit, (int, float)) else NO_TOKENIZER_LIMIT
        eos = cfg.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if isinstance(eos, str) else None

    def __call__(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> dict[str, Any]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:  # transformers' clean-up is not reproduced here
            raise ValueError("FastTokenizer does not clean up tokenization spaces")
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of `model_dir`: a FastTokenizer when it gives what transformers would,
    else transformers.AutoTokenizer's."""
    model_dir = Path(model_dir)
    if fast_path_refusal(model_dir) is None:
        return FastTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
