"""Hand-made checkpoints for validate's tests: the tiny Llama turned into a calibrated one, indexes kept right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvcalib.core.checkpoint import read_safetensors_header
from kvcalib.core.schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
    kv_only_quantization_config,
    neuron_scale_key,
)

PREFIX = (
    "Neuron only supports compressed-tensors for KV cache quantization (q_scale/k_scale/v_scale)."
)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


def sync_index(ckpt: Path) -> None:
    """Make the index describe the files on disk: every key mapped, total_size right."""
    index = read_json(ckpt / INDEX_FILENAME)
    weight_map, total = {}, 0
    for path in sorted(ckpt.glob("*.safetensors")):
        for key, info in read_safetensors_header(path).tensors.items():
            weight_map[key] = path.name
            total += info.nbytes
    index["weight_map"] = weight_map
    index["metadata"]["total_size"] = total
    write_json(ckpt / INDEX_FILENAME, index)


def make_calibrated(ckpt: Path, *, fp8_max: float = 240.0, target: str = "trn2") -> Path:
    """Turn the tiny Llama into a calibrated checkpoint, as `kvcalib calibrate` writes one."""
    config = read_json(ckpt / CONFIG_FILENAME)
    tensors, layers = {}, []
    for i in range(config["num_hidden_layers"]):
        entry: dict[str, Any] = {"layer": i}
        for kind, base in (("k", 10.0), ("v", 4.0)):
            scale = torch.tensor([(base + i) / fp8_max], dtype=torch.float32)
            entry[kind] = {"absmax": base + i, "scale": scale.item()}
            tensors[neuron_scale_key(i, kind)] = scale
        layers.append(entry)
    provenance = {"target": target, "fp8_max": fp8_max, "layers": layers}
    save_file(
        tensors,
        ckpt / SCALES_FILENAME,
        metadata={"format": "pt", "kvcalib": json.dumps(provenance)},
    )
    sync_index(ckpt)
    config["quantization_config"] = kv_only_quantization_config()
    write_json(ckpt / CONFIG_FILENAME, config)
    write_json(ckpt / PROVENANCE_FILENAME, provenance)
    return ckpt


def neuron_platform(quant_cfg: Any, neuron_config: dict | None) -> None:
    """NeuronPlatform._validate_quantization_config as its source reads (jinhuang12/vllm-neuron@25cf3c8c,
    vllm_neuron/vllm/platform.py)."""
    if isinstance(neuron_config, dict) and neuron_config.get("quantization") == "mxfp8":
        return
    if not quant_cfg:
        return
    quant_method = quant_cfg.get("quant_method")
    if isinstance(quant_method, str) and "mx" in quant_method.lower():
        raise ValueError(f"Neuron does not support MX quantization: quant_method={quant_method!r}.")
    if quant_method != "compressed-tensors":
        return  # fp8 included
    for group_name, group in quant_cfg.get("config_groups", {}).items():
        if group.get("weights"):
            raise ValueError(
                f"{PREFIX} Weight quantization in config_groups['{group_name}'] is not supported."
            )
        if group.get("output_activations"):
            raise ValueError(
                f"{PREFIX} Output activation quantization in config_groups['{group_name}'] is not "
                "supported."
            )
        if group.get("input_activations") and not any(
            "Attention" in t for t in group.get("targets", [])
        ):
            raise ValueError(
                f"{PREFIX} Input activation quantization on non-attention targets in "
                f"config_groups['{group_name}'] is not supported."
            )
