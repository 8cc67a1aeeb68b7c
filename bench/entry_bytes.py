"""Bytes of a Hypic segment entry per 1,000 cached tokens, from published model configs, beside a
plain per-token KV cache for the same tokens.

    python -m bench.entry_bytes [--tokens 1000] [--dtype bfloat16] [--json]

The model is built by our own model classes on the meta device (no weights, no memory) from the
config values typed below, and every size is read off its modules: the linear mixers' features
give H, K, V and the conv width; an attention mixer run on one (meta) token gives the per-token
keys and values it caches. An entry holds, per linear layer, T (fp32, scalar/vector/matrix form),
S [H, K, V] (fp32) and the conv tail [(kernel-1) x conv channels] (model dtype); per attention
layer, keys and values of every body token (model dtype). A segment's linear part is a constant;
its attention part grows with the tokens. Columns:

    linear/seg   the constant linear part of an entry (all linear layers), and of it T alone
    attn KV      the attention part for `tokens` body tokens, as the entry stores it (MLA: keys and
                 values up-projected per head), and in the model's own KV format (MLA: latent + rope key)
    entry        linear/seg + attn KV: one segment whose body is `tokens` tokens (seam >= kernel-1,
                 so no warm-up inputs)
    plain KV     a plain per-token KV cache of the same depth: every layer caching per-token keys and
                 values in the model's own attention-layer format (what a transformer of that shape holds)
    break-even   the body length above which an entry is smaller than the plain KV of its tokens
    per format   (second table) the entry and its break-even with T (matrix form), S and attention K/V
                 stored in each of common.engine.pic.compact's formats: fp32, bf16 (T, S), fp8t (T fp8
                 + one fp32 scale per head, S bf16), fp8 (T, S fp8 + a scale per head; K/V fp8 + one
                 fp32 scale per token and kv-head); the ratios are the fp32 entry over each format's
    low-rank     (third table, models with a K x K T) a whole entry of a short body, `--short` tokens
                 (16, 32, 64, 100), with T dense and as the builder stores it (its low-rank factors
                 where smaller: common.engine.pic.compact.lowrank_T_bytes, rank = the body's length),
                 per format, beside the plain KV of those tokens

MoE sizes and the vocabulary never enter these bytes, so the configs below shrink them to build
fast. Values are the public config.json fields as typed from memory unless marked as transformers'
config defaults (the reference checkpoint its docstring names).
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig

from common.engine.models import TEXT_SUBCONFIG, model_class
from common.engine.models.base import ForwardContext
from common.engine.pic.compact import ENTRY_FORMATS, kv_token_bytes, lowrank_T_bytes, matrix_T_bytes, tensor_bytes
from kernels.linear_attn import summary_form

# model -> (model_type, config fields that shape the cache). Expert counts and vocab trimmed (see above).
FAST = dict(vocab_size=1024)
REAL_CONFIGS: dict[str, tuple[str, dict]] = {
    "Qwen3.5-35B-A3B": ("qwen3_5_moe_text", dict(
        FAST, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=8,
    )),
    "Qwen3-Next-80B-A3B": ("qwen3_next", dict(
        FAST, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=8,
    )),
    "Kimi-Linear-48B-A3B": ("kimi_linear", dict(
        FAST, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None,
        linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
        mlp_layer_types=["dense"] * 27, intermediate_size=8,
    )),
    "Nemotron-H-8B": ("nemotron_h", dict(
        FAST, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, intermediate_size=8,
        # 52 blocks: 24 Mamba2, 24 MLP, 4 attention (the order does not change the bytes)
        layers_block_type=(["linear_attention", "mlp"] * 6 + ["full_attention"]) * 4,
    )),
    "Granite-4.0-H-Small": ("granitemoehybrid", dict(
        FAST, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        layer_types=["attention" if i in (5, 15, 25, 35) else "linear_attention" for i in range(40)],
        num_local_experts=2, num_experts_per_tok=1, intermediate_size=8, shared_intermediate_size=8,
    )),
    "MiniMax-Text-01": ("minimax", dict(
        FAST, hidden_size=6144, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        layer_types=["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)],
        num_local_experts=2, num_experts_per_tok=1, intermediate_size=8,
    )),
    # transformers' OlmoHybridConfig defaults (docstring: allenai/Olmo-Hybrid-7B)
    "Olmo-Hybrid-7B (defaults)": ("olmo_hybrid", dict(
        FAST, hidden_size=3840, num_hidden_layers=32, num_attention_heads=30, num_key_value_heads=30,
        linear_num_key_heads=30, linear_num_value_heads=30, linear_key_head_dim=96, linear_value_head_dim=192,
        linear_conv_kernel_dim=4, intermediate_size=8, pad_token_id=0, eos_token_id=1,
    )),
    # transformers' BailingHybridConfig defaults (docstring: inclusionAI/Ling-3.0-Flash)
    "Ling bailing_hybrid (defaults)": ("bailing_hybrid", dict(
        FAST, hidden_size=2560, num_hidden_layers=42, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, layer_group_size=6,
        short_conv_kernel_size=4, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=8, intermediate_size=8, pad_token_id=0, eos_token_id=1,
    )),
    "Jamba-1.5-Mini": ("jamba", dict(
        FAST, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        attn_layer_period=8, attn_layer_offset=4, mamba_expand=2, mamba_d_state=16, mamba_d_conv=4,
        num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, intermediate_size=8,
    )),
    "Falcon-H1-7B": ("falcon_h1", dict(
        FAST, hidden_size=3072, num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        mamba_n_heads=24, mamba_d_head=128, mamba_d_ssm=3072, mamba_d_state=256, mamba_n_groups=1, mamba_d_conv=4,
        intermediate_size=8,
    )),
    "Zamba2-7B": ("zamba2", dict(
        FAST, hidden_size=3584, num_hidden_layers=81, num_attention_heads=32, num_key_value_heads=32,
        n_mamba_heads=112, mamba_d_state=64, mamba_ngroups=2, mamba_d_conv=4, num_mem_blocks=2,
        layers_block_type=["hybrid" if i % 6 == 5 else "mamba" for i in range(81)],
    )),
}


def build_meta_model(model_type: str, cfg_kwargs: dict):
    cfg = AutoConfig.for_model(model_type, **cfg_kwargs)
    sub = TEXT_SUBCONFIG.get(model_type)
    cfg = getattr(cfg, sub) if sub else cfg
    with torch.device("meta"):
        return model_class(model_type)(cfg)


def linear_part_bytes(form: str, H: int, K: int, V: int, fmt: str) -> tuple[int, int]:
    """(T bytes, S bytes) of one linear layer's summary stored in `fmt` (common.engine.pic.compact:
    scalar and vector T stay fp32; fp8 adds one fp32 scale per head to each fp8 tensor)."""
    T = {"scalar": 4 * H, "vector": 4 * H * K}.get(form) or matrix_T_bytes(H, K, fmt)
    return T, tensor_bytes(H, K * V, fmt, "S")


@torch.inference_mode()
def layer_sizes(model, dtype_bytes: int) -> dict:
    """Linear layers: bytes per segment (T, S fp32; conv tail in the model dtype) and of T alone.
    Attention layers: bytes per token as our entry stores them, and in the model's own KV format
    (MLA: the compressed latent + the shared rope key; otherwise the same)."""
    out = dict(linear_per_segment=0, T_per_segment=0, attn_per_token=0, own_kv_per_token=0, n_linear=0, n_attn=0,
               matrix_T_heads=[])  # (H, K) of every layer with a K x K T
    out.update({f"linear_per_segment_{f}": 0 for f in ENTRY_FORMATS})
    out.update({f"attn_per_token_{f}": 0 for f in ENTRY_FORMATS})  # K/V as each format stores them
    x = torch.empty(1, 1, model.embed_tokens.weight.shape[1], device="meta")
    for layer in model.layers:
        mixer = layer.mixer if layer.kind != "mlp" else None
        if layer.kind == "linear":
            q, k, v, *_ = mixer.features(x, None)
            H, K, V = k.shape[2], k.shape[3], v.shape[3]
            form = summary_form(mixer.family)
            conv = dtype_bytes * (mixer.conv_kernel - 1) * mixer.conv_inputs(x).shape[-1]
            for f in ENTRY_FORMATS:
                out[f"linear_per_segment_{f}"] += sum(linear_part_bytes(form, H, K, V, f)) + conv
            out["linear_per_segment"] = out["linear_per_segment_fp32"]
            out["T_per_segment"] += linear_part_bytes(form, H, K, V, "fp32")[0]
            if form == "matrix":
                out["matrix_T_heads"].append((H, K))
            out["n_linear"] += 1
        elif layer.kind == "attention":
            ctx = ForwardContext(positions=torch.zeros(1, dtype=torch.long, device="meta"))
            width = getattr(mixer, "input_size", None)  # Zamba2's shared blocks read [hidden; embeddings]
            xa = x if width is None else torch.empty(1, 1, width, device="meta")
            _, st = mixer(xa, None, ctx)
            stored = dtype_bytes * (st.keys[0, :, 0].numel() + st.values[0, :, 0].numel())
            latent = getattr(mixer, "kv_lora_rank", None)
            out["attn_per_token"] += stored
            for f in ENTRY_FORMATS:  # one scale per token and kv-head (MLA: heads of the stored K and V)
                out[f"attn_per_token_{f}"] += sum(kv_token_bytes(t[0, :, 0].numel(), t.shape[1], f, dtype_bytes)
                                                  for t in (st.keys, st.values))
            out["own_kv_per_token"] += dtype_bytes * (latent + mixer.rope) if latent else stored
            out["n_attn"] += 1
    return out


def entry_table(tokens: int = 1000, dtype_bytes: int = 2, names=None) -> list[dict]:
    rows = []
    for name in names or REAL_CONFIGS:
        model_type, kw = REAL_CONFIGS[name]
        s = layer_sizes(build_meta_model(model_type, kw), dtype_bytes)
        own_per_layer = s["own_kv_per_token"] // max(s["n_attn"], 1)
        rows.append(dict(
            model=name, model_type=model_type, linear_layers=s["n_linear"], attention_layers=s["n_attn"],
            linear_per_segment=s["linear_per_segment"], T_per_segment=s["T_per_segment"],
            attn_kv=s["attn_per_token"] * tokens, attn_kv_own_format=s["own_kv_per_token"] * tokens,
            entry=s["linear_per_segment"] + s["attn_per_token"] * tokens,
            plain_kv=own_per_layer * (s["n_linear"] + s["n_attn"]) * tokens,
        ))
        # segment length above which an entry is smaller than the plain KV of its tokens (None: never)
        for f in ENTRY_FORMATS:
            lin, attn = s[f"linear_per_segment_{f}"], s[f"attn_per_token_{f}"]
            gain_per_token = own_per_layer * (s["n_linear"] + s["n_attn"]) - attn
            rows[-1][f"linear_per_segment_{f}"] = lin
            rows[-1][f"attn_kv_{f}"] = attn * tokens
            rows[-1][f"entry_{f}"] = lin + attn * tokens
            rows[-1][f"break_even_tokens_{f}"] = -(-lin // gain_per_token) if gain_per_token > 0 else None
        rows[-1]["break_even_tokens"] = rows[-1]["break_even_tokens_fp32"]
    return rows


SHORT_BODIES = (16, 32, 64, 100)


def lowrank_table(bodies=SHORT_BODIES, dtype_bytes: int = 2, names=None) -> list[dict]:
    """Per model with a K x K T and body length L: the entry's bytes with T dense and as built
    (each matrix layer's T as factors of rank L where that is smaller), per format, and the plain
    KV of L tokens."""
    rows = []
    for name in names or REAL_CONFIGS:
        model_type, kw = REAL_CONFIGS[name]
        s = layer_sizes(build_meta_model(model_type, kw), dtype_bytes)
        if not s["matrix_T_heads"]:
            continue
        own_per_layer = s["own_kv_per_token"] // max(s["n_attn"], 1)
        for L in bodies:
            row = dict(model=name, body=L, K=s["matrix_T_heads"][0][1],
                       plain_kv=own_per_layer * (s["n_linear"] + s["n_attn"]) * L)
            for f in ENTRY_FORMATS:
                dense_T = sum(matrix_T_bytes(H, K, f) for H, K in s["matrix_T_heads"])
                built_T = sum(min(matrix_T_bytes(H, K, f), lowrank_T_bytes(H, L, K, f)) for H, K in s["matrix_T_heads"])
                dense = s[f"linear_per_segment_{f}"] + s[f"attn_per_token_{f}"] * L
                row.update({f"dense_{f}": dense, f"lowrank_{f}": dense - dense_T + built_T,
                            f"T_dense_{f}": dense_T, f"T_lowrank_{f}": built_T})
            rows.append(row)
    return rows


def print_lowrank_table(rows: list[dict]) -> None:
    """Entry MiB of a short body, T dense -> as built (low-rank where smaller), per format."""
    mib = 2**20
    print("\nMiB per entry of a short body: T dense -> as built (low-rank factors where smaller), and /plain KV")
    print(f"{'model':32s} {'body':>4s} {'K':>4s} " + " ".join(f"{f + ' dense':>10s} {'built':>7s} {'/plain':>6s}"
                                                      for f in ENTRY_FORMATS))
    for r in rows:
        print(f"{r['model']:32s} {r['body']:4d} {r['K']:4d} " + " ".join(
            f"{r['dense_' + f] / mib:10.2f} {r['lowrank_' + f] / mib:7.2f} {r['lowrank_' + f] / r['plain_kv']:6.2f}"
            for f in ENTRY_FORMATS))


def print_format_table(rows: list[dict], tokens: int) -> None:
    """Entry MiB, entry/plain and break-even tokens per storage format of T and S."""
    mib = 2**20
    compact = [f for f in ENTRY_FORMATS if f != "fp32"]
    print(f"\nMiB per {tokens} cached tokens per entry format (T matrix form, S, fp8: K/V; scalar/vector T stay fp32)")
    print(f"{'model':32s} " + " ".join(f"{'entry ' + f:>11s} {'/plain':>6s} {'b-even':>6s}" for f in ENTRY_FORMATS)
          + " " + " ".join(f"{'fp32/' + f:>9s}" for f in compact))
    for r in rows:
        cells = [f"{r['entry_' + f] / mib:11.2f} {r['entry_' + f] / r['plain_kv']:6.3f} "
                 f"{r['break_even_tokens_' + f] or 'never':>6}" for f in ENTRY_FORMATS]
        print(f"{r['model']:32s} " + " ".join(cells)
              + " " + " ".join(f"{r['entry_fp32'] / r['entry_' + f]:9.2f}" for f in compact))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = entry_table(a.tokens, 4 if a.dtype == "float32" else 2)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    mib = 2**20
    cols = [("linear/seg", "linear_per_segment"), ("of it T", "T_per_segment"), ("attn KV", "attn_kv"),
            ("attn KV own", "attn_kv_own_format"), ("entry", "entry"), ("plain KV", "plain_kv")]
    print(f"MiB per {a.tokens} cached tokens ({a.dtype}; T and S fp32)")
    head = " ".join(f"{c:>11s}" for c, _ in cols)
    print(f"{'model':32s} {'lin/attn':>8s} {head} {'entry/plain':>11s} {'break-even':>10s}")
    for r in rows:
        print(f"{r['model']:32s} {r['linear_layers']:>3d}/{r['attention_layers']:<4d} "
              + " ".join(f"{r[k] / mib:11.2f}" for _, k in cols) + f" {r['entry'] / r['plain_kv']:11.3f}"
              + f" {r['break_even_tokens'] if r['break_even_tokens'] else 'never':>10}")
    print_format_table(rows, a.tokens)
    print_lowrank_table(lowrank_table(dtype_bytes=4 if a.dtype == "float32" else 2))

if __name__ == "__main__":
    main()
