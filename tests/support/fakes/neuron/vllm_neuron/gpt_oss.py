"""GPT-OSS on Neuron, as vllm_neuron/model/gpt_oss/ (jinhuang12/vllm-neuron ed3580d) loads it.

- factory.py: neuron_config quantization "mxfp4" -> model_mxfp4, "bf16" -> model_bf16, unset (or anything else)
  -> model_mxfp4 on trn3, model_bf16 otherwise; "mxfp4" on trn2 is refused.
- model_bf16.load_weights: the attention, norm and router tensors by name; the experts as MXFP4 pairs
  (`gate_up_proj_blocks` + `_scales`, dequantised at load) when any `gate_up_proj_blocks` is in the checkpoint,
  else as bf16 `gate_up_proj` / `down_proj`.
- model_mxfp4.load_weights: the same, with the experts always read as MXFP4 pairs (a dequantised checkpoint has
  none to read).
- _load_kv_cache_scales (both, from load_weights and from the CPU-compile load_weights_lite): only for a quantized
  KV cache; exactly `model.layers.{i}.self_attn.k_scale` / `v_scale`, sliced with `[:]` (a 0-d tensor cannot be),
  inverted in bf16 and reshaped to (1, 1) (one element, or it cannot be); a missing one is 1.0, silently.
A tensor the mapping names and the checkpoint lacks stops the load with a KeyError naming it (the lookup's own
error; how the plugin's pipelined loader words it is not public).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from vllm_neuron.checkpoint import SafetensorsCheckpoint, to_bfloat16

QUANTIZED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def select_implementation(neuron_config: Mapping[str, Any], target: str) -> str:
    """factory.py `_validate_config` then `_select_implementation`."""
    quantization = neuron_config.get("quantization")
    if quantization == "mxfp4" and target == "trn2":
        raise ValueError(
            "quantization='mxfp4' is not supported on TRN2. Please use quantization='bf16'"
        )
    if quantization in ("mxfp4", "bf16"):
        return f"model_{quantization}"
    return "model_mxfp4" if target.startswith("trn3") else "model_bf16"


def _dense_names(layer: int) -> list[str]:
    p = f"model.layers.{layer}"
    return [
        f"{p}.self_attn.{proj}.{kind}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        for kind in ("weight", "bias")
    ] + [
        f"{p}.self_attn.sinks",
        f"{p}.input_layernorm.weight",
        f"{p}.post_attention_layernorm.weight",
        f"{p}.mlp.router.weight",
        f"{p}.mlp.router.bias",
        f"{p}.mlp.experts.gate_up_proj_bias",
        f"{p}.mlp.experts.down_proj_bias",
    ]


def _mxfp4_expert(
    checkpoint: SafetensorsCheckpoint,
    name: str,
    experts: int,
    rows: int,
    cols: int,
    dequantize: bool,
) -> float | None:
    """Check one MXFP4 pair's shapes against the config; with `dequantize`, the first expert row's absmax."""
    blocks, scales = checkpoint.entry(f"{name}_blocks"), checkpoint.entry(f"{name}_scales")
    want = [experts, rows, cols // 32, 16]
    if (
        blocks["dtype"] != "U8"
        or blocks["shape"] != want
        or scales["dtype"] != "U8"
        or scales["shape"] != want[:3]
    ):
        raise RuntimeError(
            f"{name}: MXFP4 blocks {blocks['dtype']} {blocks['shape']} and scales {scales['dtype']} "
            f"{scales['shape']} do not match the config's {want} / {want[:3]} (uint8)"
        )
    if not dequantize:
        return None
    codes, exponents = (
        checkpoint.read(f"{name}_blocks", cols // 2),
        checkpoint.read(f"{name}_scales", cols // 32),
    )
    values = [
        FP4_E2M1[(byte >> shift) & 15] * 2.0 ** (exponents[i // 16] - 127)
        for i, byte in enumerate(codes)
        for shift in (0, 4)
    ]
    return max(abs(v) for v in values)


def load_weights(
    implementation: str,
    checkpoint: SafetensorsCheckpoint,
    config: Mapping[str, Any],
    log: Callable[[str], None],
) -> None:
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    names = set(checkpoint.get_tensor_names())
    mxfp4 = implementation == "model_mxfp4" or any("gate_up_proj_blocks" in k for k in names)
    wanted = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(layers):
        wanted += _dense_names(layer)
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            wanted += [f"{key}_blocks", f"{key}_scales"] if mxfp4 else [key]
    if config.get("tie_word_embeddings"):
        wanted.remove("lm_head.weight")
    missing = [k for k in wanted if k not in names]
    if missing:
        log(f"{implementation}: {len(missing)} tensors its mapping names are not in the checkpoint")
        raise KeyError(missing[0])
    if not mxfp4:
        log(f"{implementation}: experts read as bf16 ({2 * layers} tensors)")
        return
    peaks = [
        _mxfp4_expert(
            checkpoint,
            f"model.layers.{layer}.mlp.experts.{proj}",
            experts,
            rows,
            cols,
            implementation == "model_bf16",
        )
        for layer in range(layers)
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter))
    ]
    if implementation == "model_bf16":
        if not all(math.isfinite(p) for p in peaks):
            raise RuntimeError("MXFP4 dequantisation produced a non-finite expert weight")
        log(f"model_bf16: {len(peaks)} MXFP4 expert weights dequantised to bf16 at load")
    else:
        log(f"model_mxfp4: {len(peaks)} MXFP4 expert weights loaded as MXFP4")


def load_kv_cache_scales(
    checkpoint: SafetensorsCheckpoint, layers: int, kv_cache_dtype: str, log: Callable[[str], None]
) -> dict[str, float] | None:
    """The checkpoint scale each layer's kernel runs with (1 / the inverted bf16 value); None for an unquantized
    KV cache (nothing read)."""
    if kv_cache_dtype not in QUANTIZED_KV_CACHE_DTYPES:
        return None
    scales, read = {}, 0
    for layer in range(layers):
        for scale_name in ("k_scale", "v_scale"):
            key = f"model.layers.{layer}.self_attn.{scale_name}"
            if key not in checkpoint.tensor_name_to_file:
                scales[key] = 1.0
                continue
            shape = checkpoint.entry(key)["shape"]
            if shape == []:
                raise IndexError("slice() cannot be applied to a 0-dim tensor.")
            if math.prod(shape) != 1:
                raise RuntimeError(
                    f"shape '[1, 1]' is invalid for input of size {math.prod(shape)}"
                )
            scales[key] = 1.0 / to_bfloat16(1.0 / to_bfloat16(checkpoint.read(key, 1)[0]))
            read += 1
    log(f"KV cache scales: {read} of {2 * layers} read from the checkpoint, the rest 1.0")
    return scales
