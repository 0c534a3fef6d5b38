"""The tests' models, built in one place: tiny random causal LMs, configs shaped like real
checkpoints (REAL_SHAPES), and folders holding them as checkpoints do; nothing is downloaded.
Beside them, the one oracle the test files share: a tree node's ancestors, one parent at a time.

The exactness tests run these models in float64 (the default of `tiny_model` and `real_model`),
so that no near-tie between two logits can flip an argmax between a batched tree pass and a
one-token pass (in float16 such a flip is possible, as with any batched decoding; see README).
"""

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SIZES = dict(  # of every tiny model here (train_pair.TARGET_SHAPE: alike in shape only)
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_config(family, vocab=97, layers=3, **options):
    """A config of `family` (a transformers model_type) of SIZES, `vocab` tokens and `layers`
    decoder layers; `options` change or add fields."""
    return AutoConfig.for_model(
        family, **{**SIZES, "vocab_size": vocab, "num_hidden_layers": layers, **options}
    )


def random_model(config, seed=0, dtype=torch.float32, **options):
    """A random model of `config`, seeded, in `dtype`, for inference; `options` go to
    transformers' from_config (experts_implementation=...)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **options)
    return model.to(dtype).eval().requires_grad_(False)


@functools.lru_cache(maxsize=None)
def tiny_model(
    family="llama", seed=0, vocab=64, layers=2, init=0.02, context=128, dtype=torch.float64
):
    """A random causal LM of the given family, small enough to run in milliseconds.
    `init`: larger = peakier next-token distributions."""
    config = tiny_config(
        family, vocab, layers, head_dim=8, max_position_embeddings=context,
        initializer_range=init, tie_word_embeddings=False,
    )  # fmt: skip
    return random_model(config, seed, dtype)


def save_model(folder, config, seed=0, dtype=torch.float32, shard="30KB"):
    """A random model saved as (sharded, so layers straddle files) safetensors; returns it."""
    model = random_model(config, seed, dtype)
    model.save_pretrained(folder, max_shard_size=shard)
    return model.float()  # the oracle holds exactly the saved values, in float32


# ---- the families the offloader is tested on, each with what sets it apart ----

CONFIGS = {
    "llama": lambda: tiny_config("llama"),
    "qwen2": lambda: tiny_config("qwen2", tie_word_embeddings=True),  # q/k/v biases, tied head
    "qwen3": lambda: tiny_config("qwen3", head_dim=8),  # q/k norms
    "mistral": lambda: tiny_config("mistral", sliding_window=64),  # sliding-window masks
    # soft-capping, scaled embeddings, norms after attention and MLP, sliding/global layers
    "gemma2": lambda: tiny_config("gemma2", head_dim=8, sliding_window=64),
    "gemma3": lambda: tiny_config("gemma3_text", head_dim=8, sliding_window=64),  # q/k norms
    "phi3": lambda: tiny_config("phi3", pad_token_id=0),  # fused qkv and gate_up projections
    "olmo2": lambda: tiny_config("olmo2"),  # norms after attention and MLP only
    "granite": lambda: tiny_config("granite", embedding_multiplier=12.0, logits_scaling=16.0),
    "smollm3": lambda: tiny_config("smollm3", pad_token_id=0, no_rope_layer_interval=2),
    "mixtral": lambda: tiny_config("mixtral", num_local_experts=4),  # experts stored apart
    "qwen3_moe": lambda: tiny_config(
        "qwen3_moe", head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64
    ),
}


# ---- configs shaped like real checkpoints ----

# Each entry is a real checkpoint's config.json: its family and every option that changes the
# computation kept as published, only the sizes scaled down (heads and kv heads in the same
# ratio). Common sizes are SIZES'. Exactness runs these in float64, as above.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # 8192 in the checkpoints, scaled with the context
}
REAL_SHAPES = {  # entries alike in shape by design: one checkpoint's options each
    # Llama-3.1-8B: GQA 32/8, untied head, llama3 rope scaling, theta 500000
    "llama3.1": dict(
        model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
    ),
    # Llama-3.2-1B: the same with a tied head and scaling factor 32
    "llama3.2": dict(
        model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 32.0},
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M: llama, 9 heads / 3 kv heads, tied, theta 100000
    "smollm2": dict(
        model_type="llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
        rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # TinyLlama-1.1B: llama, GQA 32/4, untied
    "tinyllama": dict(
        model_type="llama", hidden_size=32, num_attention_heads=8, num_key_value_heads=1,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B: q/k/v biases, GQA 14/2, tied; its sliding window is configured but off
    "qwen2.5": dict(
        model_type="qwen2", hidden_size=56, num_attention_heads=7, num_key_value_heads=1,
        rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21,
    ),
    # Qwen3-0.6B: q/k RMSNorm, GQA 16/8, head_dim 128 != hidden / heads = 64, tied
    "qwen3": dict(
        model_type="qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    # Mistral-7B-v0.1: GQA 32/8, untied, a sliding window (4096) shorter than the context
    "mistral-v0.1": dict(
        model_type="mistral", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        sliding_window=24, tie_word_embeddings=False,
    ),
    # Qwen2 with its sliding window on: layers from max_window_layers on slide, the first not
    "qwen2-sliding": dict(
        model_type="qwen2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        use_sliding_window=True, sliding_window=24, max_window_layers=1,
    ),
    # Gemma-2-27B: sliding (4096) and global layers in turn, attention logits soft-capped at 50
    # and final logits at 30, embeddings scaled by sqrt(hidden), norms before and after
    # attention and MLP, query scale 1 / sqrt(144) with head_dim 128, tied
    "gemma2": dict(
        model_type="gemma2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=18, sliding_window=24,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # Gemma-3-1B (Gemma3ForCausalLM): five sliding layers (512) to one global (here one to
    # one), rope theta 10000 on sliding layers and 1e6 on global ones, q/k norms, GQA 4/1, tied
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=24, sliding_window_pattern=2,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, tie_word_embeddings=True,
    ),
    # Phi-3-medium-4k: fused qkv_proj and gate_up_proj, GQA 40/10, every layer slides (2047)
    "phi3": dict(
        model_type="phi3", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        sliding_window=24, pad_token_id=96, tie_word_embeddings=False,
    ),
    # OLMo-2-32B: norms after attention and MLP (none before), q/k norms over all heads,
    # GQA 40/8, theta 500000, untied
    "olmo2": dict(
        model_type="olmo2", hidden_size=40, num_attention_heads=5, num_key_value_heads=1,
        rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # Granite-3.1-8B: embeddings times 12, residual branches times 0.22, attention scaled by
    # 1 / head_dim (not its root), logits divided by 16, theta 1e7, GQA 32/8, tied
    "granite": dict(
        model_type="granite", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125,
        logits_scaling=16.0, rope_theta=10000000.0, tie_word_embeddings=True,
    ),
    # SmolLM3-3B: every 4th layer without rotary embeddings (here every 2nd), GQA 16/4, tied
    "smollm3": dict(
        model_type="smollm3", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        no_rope_layer_interval=2, rope_theta=5000000.0, pad_token_id=96, tie_word_embeddings=True,
    ),
    # Mixtral-8x7B: a mixture of 8 experts, 2 per token, GQA 32/8, no window, untied
    "mixtral": dict(
        model_type="mixtral", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
        sliding_window=None, tie_word_embeddings=False,
    ),
    # Qwen3-30B-A3B: 128 experts, 8 per token (here 32 and 2), their weights renormalized,
    # q/k norms, GQA 32/4, head_dim 128 = 2 hidden / heads, untied
    "qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=32, num_attention_heads=8, num_key_value_heads=1,
        head_dim=8, num_experts=32, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip


@functools.lru_cache(maxsize=None)
def real_model(name, layers=2, dtype=torch.float64):
    """A random model of REAL_SHAPES[name] (vocab 97, as CONFIGS').

    Norm weights and biases start as ones and zeros; they get random values here, so that a
    q/k norm or an attention bias that was dropped or misplaced would change the logits.
    """
    options = dict(REAL_SHAPES[name])
    family = options.pop("model_type")
    # initializer_range 0.3: peaky next-token distributions, as in tiny_model's init
    config = tiny_config(family, layers=layers, initializer_range=0.3, **options)
    # eager experts: transformers' default (grouped_mm) has no float64 kernel on CPU
    model = random_model(config, 0, dtype, experts_implementation="eager")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model


@functools.lru_cache(maxsize=None)
def cut_draft(name, dtype=torch.float64):
    """A draft cut from the target as users cut one: its embeddings, first layer and head."""
    draft = real_model(name, layers=1, dtype=dtype)
    # one layer of the target's config: keys of deeper layers are left out
    draft.load_state_dict(real_model(name, dtype=dtype).state_dict(), strict=False)
    return draft


def pytest_collection_modifyitems(items):
    """Tests marked `last` run after the others, in their order (test_docs' notebook and README
    script, which run beside them meanwhile)."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


def ancestors(parents, i):
    """Oracle: node i and its ancestors, one parent at a time (tree_mask walks all at once)."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain
