"""The KV cache a model holds (core.schema.kv_cache_size): 2 x layers x KV heads x head_dim x bytes per value."""

from __future__ import annotations

from kvcalib.core.schema import kv_cache_size

# GPT-OSS-120B's shape (openai/gpt-oss-120b config.json): 36 layers alternating sliding (window 128) and full.
GPT_OSS_120B = {
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


def test_the_design_docs_gpt_oss_example():
    """73,728 B/token in bf16; one 131,072-token sequence 9.66 GB in bf16, 4.83 GB in FP8 (GB = 1e9 bytes)."""
    size = kv_cache_size(GPT_OSS_120B)
    assert (
        size.per_token
        == {"bf16": 2 * 36 * 8 * 64 * 2, "fp8": 2 * 36 * 8 * 64}
        == {"bf16": 73728, "fp8": 36864}
    )
    assert size.context == 131072 and size.sequence == {
        "bf16": 73728 * 131072,
        "fp8": 36864 * 131072,
    }
    # the 18 sliding layers hold 128 tokens each, the 18 full ones all 131,072
    assert size.windowed == {"bf16": 18 * 2048 * (131072 + 128), "fp8": 18 * 1024 * (131072 + 128)}
    assert (size.window, size.sliding_layers) == (128, 18)
    assert (
        "73,728 B/token bf16, 36,864 FP8; one 131,072-token sequence (max_position_embeddings): 9.66 GB bf16, "
        "4.83 GB FP8 (its 18 sliding-window layers holding 128 tokens: 4.84 GB bf16, 2.42 GB FP8)"
    ) == size.describe()


def test_a_nested_text_config_counts_and_no_layer_types_means_no_window():
    """A multimodal config keeps the shape under text_config; a window without layer_types is not guessed at."""
    text = {
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
    }
    nested = kv_cache_size(
        {"text_config": text, "vision_config": {"num_hidden_layers": 27, "head_dim": 72}}
    )
    assert nested == kv_cache_size(text) and nested.per_token["bf16"] == 2 * 34 * 4 * 256 * 2
    assert nested.windowed is None and "sliding" not in nested.describe()
    assert kv_cache_size({"num_hidden_layers": 2}) is None
    no_context = kv_cache_size(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}
    )
    assert (
        no_context.per_token == {"bf16": 2 * 2 * 4 * 32 * 2, "fp8": 2 * 2 * 4 * 32}
        and no_context.sequence is None
    )
