"""A random-weight hybrid of a realistic shape, for timing only (its answers mean nothing).

    --random-model hidden=1024,layers=16,ratio=3:1[,intermediate=2048,vocab=4096,seed=0]

builds a Qwen3.5-pattern checkpoint (Gated DeltaNet linear layers and gated full attention,
`ratio` linear : full, full attention last in each group) with transformers' config class and
save_pretrained, into a temp dir. The bundled model's tokenizer is copied beside it (its ids
are below `vocab`), so text workloads run unchanged. Tables and JSON label it
RANDOM_LABEL.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

RANDOM_LABEL = "random weights, timing only"
DEFAULTS = dict(hidden=1024, layers=16, ratio="3:1", intermediate=0, vocab=4096, seed=0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_spec(spec: str) -> dict:
    """'hidden=1024,layers=16,ratio=3:1' -> the full spec (defaults filled in)."""
    out = dict(DEFAULTS)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in DEFAULTS:
            raise ValueError(f"bad --random-model item {part!r} (known: {', '.join(DEFAULTS)})")
        out[name] = value if name == "ratio" else int(value)
    lin, _, full = str(out["ratio"]).partition(":")
    if not (lin.isdigit() and full.isdigit() and int(full) >= 1):
        raise ValueError(f"ratio must be linear:full, e.g. 3:1, got {out['ratio']!r}")
    if out["hidden"] % 128 or out["hidden"] < 128 or out["layers"] < 1:
        raise ValueError("hidden must be a multiple of 128, layers >= 1")
    out["intermediate"] = out["intermediate"] or 2 * out["hidden"]
    return out


def layer_types(layers: int, ratio: str) -> list[str]:
    lin, full = (int(x) for x in ratio.split(":"))
    group = ["linear_attention"] * lin + ["full_attention"] * full
    return [group[i % len(group)] for i in range(layers)]


def config_kwargs(spec: dict) -> dict:
    h = spec["hidden"]
    return dict(
        vocab_size=spec["vocab"], hidden_size=h, intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], layer_types=layer_types(spec["layers"], str(spec["ratio"])),
        num_attention_heads=h // 128, num_key_value_heads=max(1, h // 512), head_dim=128,
        linear_num_key_heads=h // 128, linear_num_value_heads=h // 64, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=65536,
        tie_word_embeddings=False, bos_token_id=2, eos_token_id=5, pad_token_id=0,
    )


def save_random_model(spec: str | dict, out_dir: Path, tokenizer_from: Path | None = None) -> Path:
    """Build and save the checkpoint; returns out_dir. Also writes random_model.txt (the spec)."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    torch.manual_seed(spec["seed"])
    cfg = Qwen3_5TextConfig(**config_kwargs(spec))
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES if tokenizer_from else ():
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, out_dir / name)
    (out_dir / "random_model.txt").write_text(f"{describe(spec)}\n")
    return out_dir


def describe(spec: dict) -> str:
    return (f"random Qwen3.5-pattern hybrid, hidden {spec['hidden']}, {spec['layers']} layers, "
            f"{spec['ratio']} linear:full, intermediate {spec['intermediate']}, vocab {spec['vocab']} "
            f"({RANDOM_LABEL})")


def n_params(path: Path) -> int:
    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total
