"""Oracles independent of kvcalib: transformers' own KV cache, the calibration samples, a tree's digest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root -> sha256, to prove a directory was not touched."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def oracle_absmax(model_dir: Path, sequences: list[list[int]], attn_implementation: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V absmax read back from transformers' own KV cache after a plain forward, one sample at a time."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation).eval()
    n = model.config.num_hidden_layers
    k, v = torch.zeros(n), torch.zeros(n)
    with torch.inference_mode():
        for seq in sequences:
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([seq]), past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                k[i] = torch.maximum(k[i], layer.keys.abs().max().float())
                v[i] = torch.maximum(v[i], layer.values.abs().max().float())
    return k, v


def calibration_sequences(model_dir: Path, dataset: Path, num_samples: int, max_seq_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvcalib.hf.data import load_calibration_data

    data = load_calibration_data(str(dataset), AutoTokenizer.from_pretrained(model_dir),
                                 num_samples=num_samples, max_seq_len=max_seq_len)
    return [list(s) for s in data.sequences]

