"""Tiny random checkpoints built with transformers' own config classes and saved the way a real
checkpoint is, so that our loader walks the same path it walks for a downloaded model."""
from __future__ import annotations

from pathlib import Path

import torch


def save_tiny(model_type: str, out_dir: Path, seed: int = 0, **config_kwargs) -> Path:
    """Build transformers' model for `model_type` with random weights and save_pretrained it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **config_kwargs)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """All-position logits of transformers' model over one prompt: [T, vocab]."""
    return model(torch.tensor([ids])).logits[0].float()


def dynamic_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def hf_chunked_and_greedy(model, ids: list[int], chunks: int, steps: int, new_cache=dynamic_cache):
    """transformers' model: logits after a prefill split in `chunks`, then `steps` greedy tokens
    with the logits seen before each of them; the cache is made by `new_cache(model)` (MiniMax
    needs its own cache class)."""
    cache = new_cache(model)
    bounds = [round(i * len(ids) / chunks) for i in range(chunks + 1)]
    chunk_logits = []
    for a, b in zip(bounds, bounds[1:]):
        # explicit positions: transformers' Bamba numbers every call's tokens from 0
        out = model(torch.tensor([ids[a:b]]), position_ids=torch.arange(a, b)[None], past_key_values=cache,
                    use_cache=True)
        cache = out.past_key_values
        chunk_logits.append(out.logits[0].float())
    logits = chunk_logits[-1][-1]
    tokens, step_logits, pos = [], [], len(ids)
    for _ in range(steps):
        step_logits.append(logits)
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]), past_key_values=cache, use_cache=True)
        cache, pos = out.past_key_values, pos + 1
        logits = out.logits[0, -1].float()
    return torch.cat(chunk_logits, 0), tokens, step_logits


# Tiny configs of every architecture the engine serves, for the PIC tests. initializer_range 0.1
# keeps logits O(1) so that comparisons are not trivially small.
QWEN_BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.1,
)
QWEN_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
PIC_CONFIGS: dict[str, dict] = {
    "qwen3_5_text": QWEN_BASE,
    "qwen3_next": {**QWEN_BASE, **QWEN_MOE},
}
PIC_CONFIGS["nemotron_h"] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=64,
    initializer_range=0.1, n_groups=2,
    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
)
PIC_CONFIGS["bamba"] = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    num_hidden_layers=4, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
    mamba_chunk_size=64, initializer_range=0.1,
)
PIC_CONFIGS["kimi_linear"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    linear_num_heads=4, linear_head_dim=16, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense"] * 4,
)
# The later architectures: Granite 4 (Mamba2 + NoPE attention, MoE), MiniMax (lightning), OLMo hybrid (GDN, beta in
# (0, 2); RoPE here to exercise re-rotation), Ring / Ling 2.5 (KDA + MLA with interleaved RoPE).
PIC_CONFIGS["granitemoehybrid"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
    mamba_chunk_size=64, initializer_range=0.1, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
)
PIC_CONFIGS["minimax"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
    block_size=16, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
PIC_CONFIGS["olmo_hybrid"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=16, initializer_range=0.1, pad_token_id=0, eos_token_id=1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
PIC_CONFIGS["bailing_hybrid"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, initializer_range=0.1, pad_token_id=0, eos_token_id=1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
PIC_CONFIGS["jamba"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
    num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=2, initializer_range=0.1,
)
# Falcon-H1 with every muP multiplier away from 1 and a gated norm (the other variant in its test)
PIC_CONFIGS["falcon_h1"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
    mamba_d_state=16, mamba_chunk_size=64, mamba_rms_norm=True, mamba_norm_before_gate=False,
    initializer_range=0.1, embedding_multiplier=1.5, lm_head_multiplier=0.8, key_multiplier=0.7,
    attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_in_multiplier=1.1, ssm_out_multiplier=0.8,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.3], mlp_multipliers=[1.2, 0.7],
)
# Zamba2: two shared blocks used in turn by three hybrid layers, LoRA adapters, RoPE (MHA: transformers'
# q/k/v adapters are [2D -> 2D], so they only fit when num_key_value_heads == num_attention_heads)
PIC_CONFIGS["zamba2"] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=2, num_mem_blocks=2,
    layers_block_type=["mamba", "hybrid", "hybrid", "mamba", "hybrid"], use_shared_attention_adapter=True,
    adapter_rank=8, use_mem_rope=True, initializer_range=0.1,
)


# What the tiny tokenizer is trained on: the words the router and SDK tests send as text.
TOKENIZER_CORPUS = ["alice likes tea . bob likes milk . carol likes juice .",
                    "the quick brown fox jumps over the lazy dog ."]


def make_tiny_model(out: Path) -> Path:
    """A tiny random Qwen3.5 checkpoint with a small byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    save_tiny("qwen3_5_text", out, **QWEN_BASE)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out
