"""A tiny Llama with the mechanism that makes absmax / fp8_max the worst scale: near-constant outlier K channels.

Built by scripts/make_constant_k_model.py's own code from a tiny random Llama (head_dim 32, rope_theta 1e6,
so the lowest-frequency pairs barely rotate): in layer 0, KV head 0, eight K channels sit at constants of
200-350 on the FP8 rounding midpoints of the scale absmax / 240 takes, their spread across tokens a fraction
of one, and the query heads that read that KV head weigh them with a bias of ±3.
"""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import SCRIPTS, build_tokenizer


def build_planted_llama(out_dir: Path, dataset: Path, target: str = "trn2") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=1e6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    base = out_dir.parent / f"{out_dir.name}-base"
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # K's own spread of the order of one, as in a trained model
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(20.0)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    sys.path.insert(0, str(SCRIPTS))
    try:
        from make_constant_k_model import make
    finally:
        sys.path.pop(0)
    make(base, out_dir, str(dataset), target=target, k_spread=0.05, num_samples=16, max_seq_len=64)
    return out_dir
