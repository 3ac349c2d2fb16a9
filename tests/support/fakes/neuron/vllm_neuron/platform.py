"""The Neuron platform's checks, as vllm_neuron/vllm/platform.py (jinhuang12/vllm-neuron) runs them.

`validate_quantization_config` is `NeuronPlatform._validate_quantization_config`, in its order: the CPU-dequant
waiver (neuron_config quantization "mxfp8": nothing is checked), MX methods refused (any quant_method containing
"mx"), block-scaled fp8 admitted, and for compressed-tensors only KV-cache quantization (no weights, no output
activations, input activations only on attention targets). Messages are the plugin's own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SUPPORTED_QUANTIZATION = ["neuron_quant", "compressed-tensors", "modelopt", "fp8"]
CPU_DEQUANT_QUANTIZATIONS = frozenset({"mxfp8"})
_KV_ONLY = (
    "Neuron only supports compressed-tensors for KV cache quantization (q_scale/k_scale/v_scale). "
)


def platform_target(env: Mapping[str, str] = os.environ) -> str:
    """The chip the plugin compiles for: NEURON_PLATFORM_TARGET_OVERRIDE, else the host's (the fake neuron-ls's)."""
    return env.get("NEURON_PLATFORM_TARGET_OVERRIDE") or env.get("FAKE_NEURON_LS") or "trn2"


def validate_quantization_config(quant_cfg: Any, neuron_config: Mapping[str, Any]) -> None:
    """ValueError where the platform refuses config.json's quantization_config."""
    if neuron_config.get("quantization") in CPU_DEQUANT_QUANTIZATIONS:
        return
    if not quant_cfg:
        return
    quant_method = quant_cfg.get("quant_method")
    if isinstance(quant_method, str) and "mx" in quant_method.lower():
        raise ValueError(
            f"Neuron does not support MX quantization: quant_method={quant_method!r}. The compile target is trn2 "
            f"(gen3), whose matmul substrate has no MX path. Use one of {SUPPORTED_QUANTIZATION}, or select a Neuron "
            "CPU-dequant path with additional_config['neuron_config']['quantization']."
        )
    if quant_method != "compressed-tensors":
        return
    for name, group in (quant_cfg.get("config_groups") or {}).items():
        if group.get("weights"):
            raise ValueError(
                _KV_ONLY + f"Weight quantization in config_groups['{name}'] is not supported."
            )
        if group.get("output_activations"):
            raise ValueError(
                _KV_ONLY
                + f"Output activation quantization in config_groups['{name}'] is not supported."
            )
        if group.get("input_activations") and not any(
            "Attention" in t for t in group.get("targets", [])
        ):
            raise ValueError(
                _KV_ONLY + "Input activation quantization on non-attention targets in "
                f"config_groups['{name}'] is not supported."
            )
