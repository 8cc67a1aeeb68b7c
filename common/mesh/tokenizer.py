"""A model's tokenizer for the services that only tokenize (router, front), loaded without
importing torch where that gives what transformers.AutoTokenizer gives.

Why: AutoTokenizer first imports transformers' model-config machinery and with it torch, about
4.5 s of CPU at the start of a process that needs neither (the router and the front were the
mesh's slowest starts after the model workers). Where transformers' generic tokenizer class
(TokenizersBackend, formerly PreTrainedTokenizerFast) is what AutoTokenizer would pick and it would
load tokenizer.json unchanged (`fast_path_refusal` says None):

- `load_tokenizer` (the router) runs tokenizer.json with the `tokenizers` library itself, which is
  what that class calls for every encode and decode (`FastTokenizer`; no transformers at all);
- `load_transformers_tokenizer` loads that class straight from its module, without
  AutoTokenizer's model-config detour (the front's fallback where its own chat-template renderer,
  services/front/chat_render.py, does not apply).

Anything else (a model-specific tokenizer class, added tokens declared only in
tokenizer_config.json, a model type AutoTokenizer overrides the declared class for...) goes
through AutoTokenizer as before. tests/mesh/test_tokenizer.py holds both paths to AutoTokenizer on
random text and ids.
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
# tokenizer_config.json keys that change nothing the services do (encode without special tokens,
# decode skipping them, render the chat template): any other key (added_tokens_decoder,
# extra_special_tokens, split_special_tokens, add_bos_token, add_prefix_space, auto_map...) may,
# so it keeps AutoTokenizer.
INERT_KEYS = frozenset(SPECIAL_TOKEN_KEYS) | {
    "backend", "tokenizer_class", "model_max_length", "chat_template", "is_local",
    "local_files_only", "clean_up_tokenization_spaces", "model_input_names", "padding_side",
    "truncation_side", "name_or_path"}
# Model types whose declared tokenizer class AutoTokenizer replaces by the one it registers for
# the type (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; a test fails when the
# installed transformers lists one more).
OVERRIDDEN_MODEL_TYPES = frozenset({
    "arctic", "chatlm", "ernie4_5", "ernie4_5_moe", "fuyu", "h2ovl_chat", "hyperclovax",
    "hyperclovax_vlm", "hyperclovax_vision_v2", "internlm2", "internlm3", "iquestcoder", "jamba",
    "llava", "llava_next", "minicpm3", "minicpmv", "minimax_m2", "modernbert",
    "modernbert-decoder", "molmo", "molmo2", "nemotron", "nvfp4", "opencua", "openvla",
    "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen4_exp", "step3_vl", "vipllava", "cohere_asr", "camembertv2-base",
    "siglip2", "smolvlm"})
# Files of the Mistral format, which AutoTokenizer may load with mistral-common instead.
MISTRAL_FILES = ("tekken.json", "params.json")
# transformers patches the pre-tokenizer of some tokenizers this large (Mistral's regex).
MAX_FAST_VOCAB = 100_000


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def fast_path_refusal(model_dir: str | Path) -> str | None:
    """Why AutoTokenizer must load this directory's tokenizer (None: the generic class loads
    tokenizer.json unchanged, so `FastTokenizer` and that class give what AutoTokenizer gives)."""
    model_dir = Path(model_dir)
    tok_file, cfg_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tok_file.is_file() or not cfg_file.is_file():
        return "no tokenizer.json and tokenizer_config.json"
    cfg = _read_json(cfg_file)
    if cfg.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer class {cfg.get('tokenizer_class')!r}"
    other = sorted(set(cfg) - INERT_KEYS)
    if other:
        return f"tokenizer_config.json sets {', '.join(other)}"
    model_type = _read_json(model_dir / "config.json").get("model_type")
    if model_type in OVERRIDDEN_MODEL_TYPES:
        return f"AutoTokenizer picks its own class for model type {model_type!r}"
    if any((model_dir / f).exists() for f in MISTRAL_FILES):
        return "a Mistral-format tokenizer"
    raw = _read_json(tok_file)
    if raw.get("truncation") is not None or raw.get("padding") is not None:
        return "tokenizer.json sets truncation or padding"
    if len(raw.get("model", {}).get("vocab") or ()) > MAX_FAST_VOCAB:
        return f"a vocabulary over {MAX_FAST_VOCAB} (transformers may patch its pre-tokenizer)"
    special = {t.get("content") for t in raw.get("added_tokens", []) if t.get("special")}
    named = [cfg[k] for k in SPECIAL_TOKEN_KEYS if cfg.get(k) is not None]
    if not all(isinstance(t, str) and t in special for t in named):
        return "a special token of tokenizer_config.json is not one of tokenizer.json's"
    return None


class FastTokenizer:
    """tokenizer.json through `tokenizers`, with the slice of transformers' tokenizer interface
    the router uses: __call__(texts, add_special_tokens=False)["input_ids"], decode(ids, ...),
    model_max_length, eos_token_id."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        cfg = _read_json(model_dir / "tokenizer_config.json")
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
    """The router's tokenizer of `model_dir`: a FastTokenizer when it gives what AutoTokenizer
    would, else AutoTokenizer's."""
    if fast_path_refusal(model_dir) is None:
        return FastTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_transformers_tokenizer(model_dir: str | Path) -> Any:
    """The transformers tokenizer AutoTokenizer.from_pretrained(model_dir) gives, without
    importing torch where the generic class is the one it would pick."""
    if fast_path_refusal(model_dir) is None:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
