"""MXFP4 experts (GPT-OSS as released, and kvcalib's Neuron form of it): `<experts>.gate_up_proj_blocks` (FP4
codes) beside `..._scales` (exponents), the same for down_proj. Calibrated as they are (transformers dequantizes them
on load); the output keeps them, linked, under a KV-only config. Neuron reads them by name: jinhuang12/vllm-neuron at
ed3580d, vllm_neuron/model/gpt_oss/factory.py picks model_bf16.py or model_mxfp4.py by neuron_config quantization,
else by chip (trn3 mxfp4), and refuses mxfp4 on trn2; vllm-project/vllm-neuron at b8834a3,
docs/model-recipes/gpt-oss.md serves the released checkpoint on trn2 with its quantization_config emptied. GPU vLLM
(0.32) gives attention no quant method under its MXFP4 config (vllm/model_executor/layers/quantization/mxfp4.py,
Mxfp4Config.get_quant_method): FP8 KV runs at 1.0, so --target gpu is refused (`dequantize_mxfp4` makes a bf16 form).

Dequantising them as transformers loads them is kvcalib.hf.mxfp4's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.errors import UnsupportedModelError, UsageError
from kvcalib.core.fp8 import TARGETS, Target, get_target

__all__ = [
    "BLOCKS",
    "SCALES",
    "TRN2_CAUSE",
    "check_calibration",
    "findings",
    "neuron_quantization",
    "weights",
]

BLOCKS, SCALES = "_blocks", "_scales"
DEQUANTIZE_COMMAND = "python -c \"import kvcalib; kvcalib.dequantize_mxfp4('MODEL', 'BF16_DIR')\""
TRN2_CAUSE = (
    r"quantization='mxfp4' is not supported on TRN2",
    "vLLM-Neuron's GPT-OSS runs MXFP4 experts as MXFP4 only on trn3 (vllm_neuron/model/gpt_oss/factory.py)",
    (
        'on trn2 serve with --additional-config \'{"neuron_config": {"quantization": "bf16"}}\' '
        "(kvcalib's model card and serve-check pass it)"
    ),
)


def weights(keys: Iterable[str]) -> list[str]:
    """The weights stored as MXFP4 (a `<name>_blocks` and `<name>_scales` pair) among tensor keys: their names."""
    keys = set(keys)
    return sorted(
        k.removesuffix(BLOCKS)
        for k in keys
        if k.endswith(BLOCKS) and k.removesuffix(BLOCKS) + SCALES in keys
    )


def neuron_quantization(target: str) -> str | None:
    """The neuron_config quantization GPT-OSS needs on a Neuron `target`: mxfp4 on trn3, bf16 on trn2."""
    chip = TARGETS.get(target)
    return None if chip is None or not chip.neuron else "mxfp4" if chip.mxfp4 else "bf16"


def check_calibration(checkpoint: Checkpoint, target: Target, engine: str) -> dict[str, Any]:
    """calibrate's MXFP4 rules (GPU and llm-compressor refused); what the provenance records of them."""
    names = weights(checkpoint.files.key_files)
    if not names:
        return {}
    if not target.neuron:
        raise UnsupportedModelError(
            f"{checkpoint.root}: the experts are MXFP4: GPU vLLM's MXFP4 support loads no KV scales (Mxfp4Config "
            "gives attention no quantization method), so FP8 KV would run at scale 1.0 whatever kvcalib writes",
            hint=f"for GPU, dequantize the experts to bf16 first and calibrate that checkpoint: {DEQUANTIZE_COMMAND}; "
            "for Neuron (--target trn2 or trn3) calibrate the MXFP4 checkpoint as it is",
        )
    if engine == "llmcompressor":
        raise UsageError(
            "--engine llmcompressor does not dequantise MXFP4 experts; kvcalib's engines do",
            hint="drop --engine llmcompressor (native, or stream for models larger than memory)",
        )
    return {
        "mxfp4_weights": len(names),
        "source_quantization_config": checkpoint.config.get("quantization_config"),
    }


def findings(
    config: dict[str, Any], keys: Iterable[str], target: str
) -> list[tuple[str, str, str, str, str]]:
    """validate's MXFP4 rules as Finding fields: CKPT-MXFP4-PAIR, PORT-MXFP4-GPU, PORT-MXFP4-NEURON."""
    keys = set(keys)
    names = weights(keys)
    orphans = sorted(
        k
        for k in keys
        if k.endswith((BLOCKS, SCALES)) and "experts" in k and k.rsplit("_", 1)[0] not in names
    )
    found = [
        (
            "CKPT-MXFP4-PAIR",
            "error",
            f"{key}: an MXFP4 tensor without its other half (`_blocks` and `_scales` "
            "come in pairs): no loader can dequantise it",
            "restore the weight files from the released checkpoint",
            key,
        )
        for key in orphans[:3]
    ]
    qcfg = config.get("quantization_config")
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if names and not get_target(target).neuron:
        found.append(
            (
                "PORT-MXFP4-GPU",
                "error",
                f"{len(names)} expert weights are MXFP4 ({names[0]}_blocks, ...): GPU vLLM reads them only under its "
                "MXFP4 config, which loads no KV scales (FP8 KV at scale 1.0)"
                + (
                    ""
                    if method == "mxfp4"
                    else f", and under this {method or 'missing'} config it cannot load them"
                ),
                f"calibrate the dequantised form for GPU: {DEQUANTIZE_COMMAND}, "
                "then kvcalib calibrate BF16_DIR --target gpu",
                "config.json:quantization_config",
            )
        )
    elif names and method != "mxfp4":  # kvcalib's Neuron form
        quantization = neuron_quantization(target)
        found.append(
            (
                "PORT-MXFP4-NEURON",
                "info",
                f"{len(names)} expert weights are MXFP4, kept as released: Neuron's GPT-OSS model reads them by name "
                f"(on {target}: neuron_config quantization {quantization!r})",
                f'serve with --kv-cache-dtype fp8 --additional-config \'{{"neuron_config": {{"quantization": '
                f"\"{quantization}\"}}}}' (the model card's command)",
                "config.json:quantization_config",
            )
        )
    return found
