"""What a model directory says about itself to a user: `hypic_model.json` beside config.json,
{"description": one line on what the model is and how to serve another, "trained_prompt_tokens":
the prompt lengths it was trained and evaluated on}. bench/quality/readme.py writes it for the
bundled model (so that `hypic up`'s banner and the front's `/v1/models` card say it is a toy);
a Hugging Face checkpoint has none, and then nothing is added."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CARD_FILE = "hypic_model.json"


def model_card(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The card's fields ({} when the directory has no readable card: it is optional)."""
    try:
        raw = json.loads((Path(model_dir) / CARD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    if isinstance(raw.get("description"), str):
        out["description"] = raw["description"]
    if isinstance(raw.get("trained_prompt_tokens"), int):
        out["trained_prompt_tokens"] = raw["trained_prompt_tokens"]
    return out
