"""Tiny random configurations of every model family kvcalib serves: the K/V tests in tests/hf/test_families.py
and scripts/vllm_scales_table.py (which scales vLLM's own loader takes, per family) build the same models."""

from __future__ import annotations

FAMILIES = [
    "llama3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt_oss",
]
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def family_config(name: str, vocab_size: int, pad_id: int):
    import transformers as tf

    config_cls, extra = {
        "llama3": (
            tf.LlamaConfig,
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            ),
        ),
        "qwen2": (
            tf.Qwen2Config,
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        ),
        "qwen3": (tf.Qwen3Config, {}),
        "qwen3_moe": (
            tf.Qwen3MoeConfig,
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        ),
        "mistral": (tf.MistralConfig, dict(sliding_window=8)),
        "gemma2": (
            tf.Gemma2Config,
            dict(attn_logit_softcapping=2.0, final_logit_softcapping=None, sliding_window=8),
        ),
        "gemma3": (tf.Gemma3TextConfig, dict(sliding_window=8)),
        "phi3": (tf.Phi3Config, {}),
        "gpt_oss": (
            tf.GptOssConfig,
            dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
        ),
    }[name]
    kwargs = {
        **COMMON,
        **extra,
        "vocab_size": vocab_size,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if name == "phi3":
        kwargs.pop("head_dim")  # hidden_size / heads
    return config_cls(**kwargs)
