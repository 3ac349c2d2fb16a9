#!/usr/bin/env python3
"""Write a Llama checkpoint of any size with random weights, one tensor at a time.

Nothing the size of the model is ever in memory: the architecture comes from a meta-device
model (names, shapes), each tensor is drawn, cast and written shard by shard (one shard per
decoder layer, one for the embedding, final norm and LM head), then the index, config.json
and the tokenizer are saved. For memory and throughput benchmarks and for tests of models
larger than a memory cap; the weights are noise (std 0.02 for projections, norms 1).

    python scripts/make_synthetic_llama.py OUT --hidden 2048 --intermediate 8192 --layers 24
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def build_synthetic_llama(
    out_dir: Path,
    tokenizer: Any,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> int:
    """Write the checkpoint under `out_dir`; returns the bytes of its weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer-{int(m.group(1)):05d}" if m else "rest", []).append(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    names = sorted(groups)
    weight_map: dict[str, str] = {}
    total = 0
    for s, group in enumerate(names):
        file = f"model-{s + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = {}
        for name in groups[group]:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shapes[name], dtype=getattr(torch, dtype))
            else:
                tensor = (torch.randn(shapes[name], generator=generator) * 0.02).to(
                    getattr(torch, dtype)
                )
            tensors[name] = tensor
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            f,
            indent=2,
        )
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from helpers import build_tokenizer

    size = build_synthetic_llama(
        args.out,
        build_tokenizer(),
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        dtype=args.dtype,
    )
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
