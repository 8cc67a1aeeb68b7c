"""model_type (config.json) -> our model class. Each family adds itself here."""
from __future__ import annotations

import importlib

# model_type -> "module:Class"; imported lazily so one family's import error can't break another.
MODEL_REGISTRY: dict[str, str] = {
    "qwen3_5": "common.engine.models.qwen3_5:Qwen35LM",
    "qwen3_5_text": "common.engine.models.qwen3_5:Qwen35LM",
    "qwen3_5_moe": "common.engine.models.qwen3_5:Qwen35LM",
    "qwen3_5_moe_text": "common.engine.models.qwen3_5:Qwen35LM",
    "qwen3_next": "common.engine.models.qwen3_5:Qwen3NextLM",
    "kimi_linear": "common.engine.models.kimi_linear:KimiLinearLM",
    "nemotron_h": "common.engine.models.nemotron_h:NemotronHLM",
    "bamba": "common.engine.models.bamba:BambaLM",
    "granitemoehybrid": "common.engine.models.granitemoehybrid:GraniteMoeHybridLM",
    "minimax": "common.engine.models.minimax:MiniMaxLM",
    "olmo_hybrid": "common.engine.models.olmo_hybrid:OlmoHybridLM",
    "bailing_hybrid": "common.engine.models.bailing_hybrid:BailingHybridLM",
    "jamba": "common.engine.models.jamba:JambaLM",
    "falcon_h1": "common.engine.models.falcon_h1:FalconH1LM",
    "zamba2": "common.engine.models.zamba2:Zamba2LM",
}

# Composite configs (vision-language wrappers) whose text model we serve.
TEXT_SUBCONFIG = {"qwen3_5": "text_config", "qwen3_5_moe": "text_config"}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(model_type: str):
    if model_type not in MODEL_REGISTRY:
        raise UnsupportedArchitecture(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    module, cls = MODEL_REGISTRY[model_type].split(":")
    return getattr(importlib.import_module(module), cls)
