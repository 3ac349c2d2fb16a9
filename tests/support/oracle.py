"""Oracles independent of kvcalib: transformers' own KV cache, the calibration samples, a tree's digest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvcalib.hf.internals import cache_kwargs


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root -> sha256, to prove a directory was not touched."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def oracle_absmax(
    model_dir: Path,
    sequences: list[list[int]],
    attn_implementation: str | None = None,
    dtype: str | torch.dtype = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V absmax read back from transformers' own KV cache after a plain forward, one sample at a time."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn_implementation, dtype=dtype
    ).eval()
    n = model.config.num_hidden_layers
    k, v = torch.zeros(n), torch.zeros(n)
    with torch.inference_mode():
        for seq in sequences:
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([seq]), **cache_kwargs(model, cache), use_cache=True)
            for i, layer in enumerate(cache.layers):
                k[i] = torch.maximum(k[i], layer.keys.abs().max().float())
                v[i] = torch.maximum(v[i], layer.values.abs().max().float())
    return k, v


def calibration_sequences(
    model_dir: Path, dataset: Path, num_samples: int, max_seq_len: int
) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.hf.data import load_calibration_data

    data = load_calibration_data(
        str(dataset),
        AutoTokenizer.from_pretrained(model_dir),
        CalibrateOptions(num_samples=num_samples, max_seq_len=max_seq_len),
    )
    return [list(s) for s in data.sequences]


def oracle_heads(
    model_dir: Path,
    sequences: list[list[int]],
    dtype: str = "auto",
    attn_implementation: str = "eager",
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: K and V absmax per KV head read back from transformers' own DynamicCache, and Q absmax per
    attention head as the model hands Q (after RoPE and q-norm) to its own eager attention function,
    captured by wrapping that function in the model's modeling module (Q only with eager attention).
    One sample at a time (no padding)."""
    import sys

    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn_implementation, dtype=dtype
    ).eval()
    modeling = sys.modules[type(model).__module__]
    real = modeling.eager_attention_forward
    n = model.config.num_hidden_layers
    k: list = [None] * n
    v: list = [None] * n
    q: list = [None] * n

    def grow(store: list, i: int, states: torch.Tensor) -> None:
        heads = states.detach().abs().amax(dim=(0, 2, 3)).float()
        store[i] = heads if store[i] is None else torch.maximum(store[i], heads)

    def spy(module, query, *args, **kwargs):
        grow(q, module.layer_idx, query)
        return real(module, query, *args, **kwargs)

    modeling.eager_attention_forward = spy
    try:
        with torch.inference_mode():
            for seq in sequences:
                cache = DynamicCache()  # no config: every layer keeps every token
                model(input_ids=torch.tensor([seq]), **cache_kwargs(model, cache), use_cache=True)
                for i, layer in enumerate(cache.layers):
                    grow(k, i, layer.keys)
                    grow(v, i, layer.values)
    finally:
        modeling.eager_attention_forward = real
    return k, v, q
