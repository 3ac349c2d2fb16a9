"""MXFP4 experts (GPT-OSS as released, and kvcalib's Neuron form of it): which server reads them with the scales.

- Neuron: the GPT-OSS models read the expert tensors by name, `<experts>.gate_up_proj_blocks` / `_scales`
  (vllm-neuron fork jinhuang12/vllm-neuron, vllm_neuron/model/gpt_oss/: model_bf16.py dequantizes them at load,
  model_mxfp4.py runs them as MXFP4; factory.py picks by neuron_config quantization "bf16" / "mxfp4", else by
  chip: trn3 mxfp4, otherwise bf16, and refuses mxfp4 on trn2). The upstream recipe serves the released
  checkpoint on trn2 with its quantization_config emptied (vllm-project/vllm-neuron,
  docs/model-recipes/gpt-oss.md). kvcalib's form declares a KV-only compressed-tensors config instead of the
  MXFP4 one, which the platform's quantization check accepts under either reading of its MX exemption.
- GPU vLLM: MXFP4 weights load only under its MXFP4 quantization config, which gives attention no quantization
  method (vllm/model_executor/layers/quantization/mxfp4.py), so no KV scale is read; under a compressed-tensors
  config it expects bf16 experts and cannot load the blocks. The GPU form has bf16 experts.

Rule ids: PORT-MXFP4-GPU (error, --target gpu), PORT-MXFP4-NEURON (info, trn2/trn3: how to serve it),
CKPT-MXFP4-PAIR (error: a `_blocks` tensor without its `_scales`, or the reverse).
"""

from __future__ import annotations

from typing import Any

from kvcalib.core.checkpoint import CheckpointFiles
from kvcalib.core.fp8 import get_target
from kvcalib.core.schema import MXFP4_BLOCKS, MXFP4_SCALES, NEURON_QUANTIZATION, mxfp4_weights
from kvcalib.validation.report import ERROR, INFO, Finding

__all__ = ["mxfp4_findings"]

_DEQUANTIZE = ("calibrate the dequantised form for GPU: python -c \"from kvcalib.hf.model import dequantize_mxfp4; "
               "dequantize_mxfp4('MODEL', 'BF16_DIR')\", then kvcalib calibrate BF16_DIR --target gpu")


def mxfp4_findings(config: dict[str, Any], scan: CheckpointFiles, target: str) -> list[Finding]:
    keys = set(scan.key_files)
    weights = mxfp4_weights(keys)
    orphans = sorted(k for k in keys if k.endswith((MXFP4_BLOCKS, MXFP4_SCALES)) and "experts" in k
                     and k.rsplit("_", 1)[0] not in weights)
    findings = [Finding("CKPT-MXFP4-PAIR", ERROR, f"{key}: an MXFP4 tensor without its other half (`_blocks` and "
                        "`_scales` come in pairs): no loader can dequantise it",
                        "restore the weight files from the released checkpoint", key) for key in orphans[:3]]
    if not weights:
        return findings
    qcfg = config.get("quantization_config")
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if not get_target(target).neuron:
        findings.append(Finding(
            "PORT-MXFP4-GPU", ERROR,
            f"{len(weights)} expert weights are MXFP4 ({weights[0]}_blocks, ...): GPU vLLM reads them only under its "
            "MXFP4 config, which loads no KV scales (FP8 KV at scale 1.0)"
            + ("" if method == "mxfp4" else f", and under this {method or 'missing'} config it cannot load them"),
            _DEQUANTIZE, "config.json:quantization_config",
        ))
    elif method != "mxfp4":  # kvcalib's Neuron form (the released one gets NEURON-QCFG-MX from the platform check)
        quantization = NEURON_QUANTIZATION.get(target, "bf16")
        findings.append(Finding(
            "PORT-MXFP4-NEURON", INFO,
            f"{len(weights)} expert weights are MXFP4, kept as released: Neuron's GPT-OSS model reads them by name "
            f"(on {target}: neuron_config quantization {quantization!r})",
            f"serve with --kv-cache-dtype fp8 --additional-config '{{\"neuron_config\": {{\"quantization\": "
            f"\"{quantization}\"}}}}' (the model card's command)", "config.json:quantization_config",
        ))
    return findings
