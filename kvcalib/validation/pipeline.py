"""`kvcalib validate`: will vLLM on Neuron accept this checkpoint, and use its scales?

Reads config.json, the index, the safetensors headers and the scale tensors only. `validate_checkpoint` raises only
when the checkpoint cannot be read at all or the target is unknown; everything else is a `Finding`. Stable rule ids:

1. The Neuron platform's quantization-config validator, exactly (jinhuang12/vllm-neuron,
   vllm_neuron/vllm/platform.py), after vLLM's normalisation of quantization_config (validation/config.py):
   - NEURON-QCFG-MX            error  quant_method contains "mx" (mxfp4, gpt_oss_mxfp4, ...)
   - NEURON-QCFG-WEIGHTS       error  a config group quantizes weights
   - NEURON-QCFG-OUTPUT-ACT    error  a config group quantizes output activations
   - NEURON-QCFG-INPUT-ACT     error  input activations on targets none of which contains "Attention"
   - NEURON-QCFG-MALFORMED     error  a shape vLLM or the platform crashes on (a non-object, a non-string, ...)
   - NEURON-QCFG-MODELOPT-ALGO error  a ModelOpt quant_algo vLLM does not know (it raises)
2. NEURON-LLAMA-QUANT-METHOD   error  Llama model, quant_method not compressed-tensors/modelopt
3. The scales Neuron reads, model.layers.{i}.self_attn.{k,v}_scale (validation/scales.py, heads.py):
   - SCALE-MISSING        error    a key is missing while others are there: that layer runs at 1.0
   - SCALE-FOREIGN-NAME   error    only under a name Neuron ignores (kv_scale, k_proj.output_scale, ...)
   - SCALE-SHAPE          error    shape [] (loader IndexError) or more than one element (reshape)
   - SCALE-VALUE          error    non-finite, zero, negative, or 1/s not finite non-zero in bf16
   - SCALE-ALL-ZERO       error    every k_scale (or v_scale) is 0.0: one finding naming the layers
   - SCALE-UNREADABLE     error    the scale's bytes cannot be read
   - SCALE-IMPLAUSIBLE    warning  above 64 (|x| <= 1 becomes an FP8 subnormal) or below 1e-6
   - SCALE-DTYPE          warning  not float32
   - SCALE-UNCALIBRATED   warning  every scale is exactly 1.0
   - SCALE-NONE           warning  no KV scales at all (error when a kv_cache_scheme is declared)
   - SCALE-NO-KV-SCHEME   warning  scales but no kv_cache_scheme (error for --target gpu)
   - SCALE-LAYER-COUNT    warning  no usable num_hidden_layers; the layers the scales name are checked
   - SCALE-EXTRA-LAYER    warning  scales for layers the model does not have
   - SCALE-HEADS          error    --target gpu, attn_head: a per-head scale of the wrong count or value
   - SCALE-Q-UNUSED       info     q_scale on Neuron: not consumed by the plugin today
   - SCALE-Q-MISSING      warning  --target gpu: FP8 attention declared, a layer has no q_scale (1.0)
   - SCALE-Q-SHAPE/VALUE  error    --target gpu: a q_scale vLLM cannot load
4. Checkpoint integrity, for both Neuron loader variants (validation/files.py):
   - CKPT-NO-SAFETENSORS     error  no *.safetensors file and no index
   - CKPT-HEADER             error  a safetensors header does not parse (truncated, oversized, ...)
   - CKPT-INDEX-UNREADABLE   error  the index is not JSON, or its weight_map is not an object
   - CKPT-INDEX-FILE-NAME    error  weight_map names a file that is not a bare *.safetensors name
   - CKPT-INDEX-FILE-MISSING error  weight_map names a file that does not exist
   - CKPT-INDEX-KEY-UNMAPPED error for a scale key, warning for others: in a file but not in weight_map
   - CKPT-INDEX-KEY-STALE    same severities: weight_map points at a file that lacks the key
   - CKPT-DUPLICATE-KEY      error  one key in two files
   - CKPT-TOTAL-SIZE         warning metadata.total_size is not the sum of the mapped tensors' bytes
   - CKPT-SINGLE-FILE-SHADOWS-INDEX warning  a model.safetensors beside an index (transformers reads only it)
5. The FP8 range, from kvcalib's provenance (validation/scales.py, clips.py, outliers.py, tokens.py):
   - RANGE-TARGET-MISMATCH      error  sized for a larger FP8 max than the target's; info when smaller
   - RANGE-CLIPPED-UNSCORED     warning clipped scales not scored on the target's numerics (`scored_on`)
   - RANGE-PROVENANCE-DISAGREES warning the tensors (or the two records) disagree with it
   - RANGE-PROVENANCE-MALFORMED warning unreadable provenance
   - RANGE-UNKNOWN              info   scales present, no provenance: FP8 max unknown
   - OUTLIER-K-CHANNELS         warning k_proj biases put near-constant K channels high in an absmax range
   - OUTLIER-K-UNKNOWN          info   kvcalib sized the scales by absmax, no k_proj bias to probe
   - CALIB-TOKENS-NOT-AS-SERVED warning calibrated without the special tokens (BOS) vLLM adds to prompts
6. Portability (validation/config.py, heads.py; core/mxfp4.py):
   - KV-OBSERVER                warning kv_cache_scheme's observer is not the whole set's maximum
   - PORT-KV-SCHEME-INVALID     error  kv_cache_scheme does not parse as QuantizationArgs
   - PORT-KV-SCHEME-FORMAT      error  not num_bits 8, type float, symmetric
   - PORT-KV-SCHEME-STRATEGY    error  strategy not "tensor" or dynamic not false (gpu: warning; attn_head: info)
   - PORT-ATTENTION-GROUP       warning --target gpu: an FP8-attention group vLLM does not recognise
   - PORT-CONFIG-GROUPS-MISSING warning compressed-tensors without config_groups (error on gpu)
   - PORT-NO-SCALE-LOADER       warning scales on an architecture without a Neuron scale loader (info on gpu)
   - PORT-COMPRESSION-CONFIG    warning the 2024 key compression_config instead of quantization_config
   - PORT-MXFP4-GPU             error  --target gpu: MXFP4 experts (GPU vLLM's MXFP4 config loads no KV scales)
   - PORT-MXFP4-NEURON          info   trn2/trn3: MXFP4 experts kept as released, and how Neuron serves them
   - CKPT-MXFP4-PAIR            error  an MXFP4 `_blocks` tensor without its `_scales` (or the reverse)
"""

from __future__ import annotations

from pathlib import Path

from kvcalib.core import mxfp4
from kvcalib.core.checkpoint import read_config
from kvcalib.core.errors import UnknownTargetError
from kvcalib.core.fp8 import DEFAULT_TARGET, get_target
from kvcalib.core.schema import ATTN_HEAD
from kvcalib.validation.config import (declared_kv_cache_scheme, llama_gate, neuron_quantization_verdict,
                                       portability_findings)
from kvcalib.validation.files import scan_for_validation
from kvcalib.validation.heads import attention_group_findings, query_findings
from kvcalib.validation.outliers import outlier_findings
from kvcalib.validation.report import Finding, ValidationReport
from kvcalib.validation.scales import range_findings, scale_findings
from kvcalib.validation.tokens import token_findings

__all__ = ["validate_checkpoint"]


def validate_checkpoint(path: Path, target: str = DEFAULT_TARGET, *, strict: bool = False,
                        neuron_config: dict | None = None) -> ValidationReport:
    """Every finding for the checkpoint at `path` served on `target` ("trn2", "trn3", "gpu").

    `neuron_config` is the serve command's `additional_config["neuron_config"]`, if known.
    Raises UnknownTargetError, CheckpointNotFoundError (no directory or config.json) and
    CheckpointReadError (config.json not a JSON object); nothing else.
    """
    try:
        get_target(target)
    except ValueError as exc:
        raise UnknownTargetError(str(exc), hint="use --target trn2, trn3 or gpu") from None
    root = Path(path)
    config = read_config(root)
    verdict = neuron_quantization_verdict(config.get("quantization_config"), neuron_config)
    # the Llama model is built only once the platform has accepted the config
    first = verdict if verdict is not None else llama_gate(config)
    findings: list[Finding] = [] if first is None else [first]
    scan, integrity = scan_for_validation(root)
    scheme_declared = declared_kv_cache_scheme(config) is not None
    scales, check = scale_findings(config, scan, scheme_declared, target)
    findings += scales
    findings += integrity
    findings += range_findings(scan, check, target)
    findings += outlier_findings(config, scan, check.values, check.prefix, target)
    findings += token_findings(scan)
    findings += portability_findings(config, target, check.present)
    findings += query_findings(config, scan, target, ATTN_HEAD if check.per_head else None)
    findings += attention_group_findings(config, target)
    findings += [Finding(*found) for found in mxfp4.findings(config, scan.key_files, target)]
    return ValidationReport(str(path), target, tuple(findings), strict)
