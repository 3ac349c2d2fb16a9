"""MXFP4 as GPT-OSS checkpoints store it, written by the tests themselves (transformers reads it back).

Experts' `gate_up_proj` / `down_proj` ([experts, in, out]) become `<name>_blocks` (uint8
[experts, out, in/32, 16]: two FP4 E2M1 codes a byte, low nibble first) and `<name>_scales`
(uint8 [experts, out, in/32]: a power-of-two exponent + 127 per block of 32).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of an experts weight [E, in, out]."""
    rows = weight.transpose(1, 2).float().contiguous()  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], rows.shape[2] // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    # the nearest FP4 magnitude, a tie to the smaller one: the midpoints between magnitudes as bucket boundaries
    magnitude = torch.bucketize(scaled.abs(), (FP4_MAGNITUDES[1:] + FP4_MAGNITUDES[:-1]) / 2)
    code = magnitude + 8 * ((scaled < 0) & (magnitude > 0)).long()
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exponent + 127).to(
        torch.uint8
    )


def save_as_mxfp4(model_dir: Path) -> Path:
    """Rewrite a saved bf16 GPT-OSS checkpoint in place with MXFP4 experts, as released checkpoints are."""
    from safetensors.torch import load_file, save_file

    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
        path.unlink()
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[f"{key}_blocks"], state[f"{key}_scales"] = quantize_mxfp4(state.pop(key))
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def build_gpt_oss_mxfp4(out_dir: Path, layers: int = 3) -> Path:
    """A tiny GPT-OSS saved as released: MXFP4 experts (this module's quantiser), the MXFP4 quantization_config."""
    from helpers import build_word_tokenizer
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = build_word_tokenizer()
    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return save_as_mxfp4(out_dir)
