"""Every finding code `kvcalib validate` emits, as data: its severity, what it catches, the public source it follows
(scripts/rule_catalogue.py renders it as scripts/VALIDATE_RULES.md; tests/validate/test_rule_catalogue.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcalib.validation.report import ERROR, INFO, WARNING

__all__ = ["RULE", "RULES", "Rule"]


@dataclass(frozen=True)
class Rule:
    code: str
    severity: str  # ERROR, WARNING or INFO, or a short text where the target or the key decides
    catches: str
    follows: str  # the public source the rule follows


_PLATFORM = "jinhuang12/vllm-neuron@25cf3c8c vllm_neuron/vllm/platform.py"
_VLLM = "vllm-project/vllm@00bb6f59 vllm/transformers_utils/model_arch_config_convertor.py"
_NEURON = "jinhuang12/vllm-neuron@ed3580d vllm_neuron/model/ (_load_kv_cache_scales)"
_FILES = "jinhuang12/vllm-neuron@ed3580d vllm_neuron/utils/checkpoints.py"
_GPT_OSS = "jinhuang12/vllm-neuron@ed3580d vllm_neuron/model/gpt_oss/factory.py"
_GPU = "vllm-project/vllm vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py"
_ARGS, _OURS = "compressed-tensors QuantizationArgs", "kvcalib provenance"
_BOTH = f"{_VLLM}; {_PLATFORM}"
_BY_KEY, _NOT_GPU = "error for a KV-scale key; warning for others", "warning; error on --target gpu"

_ROWS: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "Neuron platform config": (
        (
            "NEURON-QCFG-MX",
            ERROR,
            'quant_method contains "mx" (mxfp4, gpt_oss_mxfp4, ...)',
            _PLATFORM,
        ),
        ("NEURON-QCFG-WEIGHTS", ERROR, "a config group quantizes weights", _PLATFORM),
        ("NEURON-QCFG-OUTPUT-ACT", ERROR, "a config group quantizes output activations", _PLATFORM),
        (
            "NEURON-QCFG-INPUT-ACT",
            ERROR,
            'input activations on targets none containing "Attention"',
            _PLATFORM,
        ),
        (
            "NEURON-QCFG-MALFORMED",
            ERROR,
            "a shape vLLM or the platform crashes on (a non-object, ...)",
            _BOTH,
        ),
        (
            "NEURON-QCFG-MODELOPT-ALGO",
            ERROR,
            "a ModelOpt quant_algo vLLM does not know (it raises)",
            _VLLM,
        ),
    ),
    "Llama gate": (
        (
            "NEURON-LLAMA-QUANT-METHOD",
            ERROR,
            "Llama model, quant_method not compressed-tensors or modelopt",
            "jinhuang12/vllm-neuron@ed3580d vllm_neuron/model/llama3/quantization.py",
        ),
    ),
    "Scales (model.layers.{i}.self_attn.{k,v}_scale)": (
        (
            "SCALE-MISSING",
            ERROR,
            "a key is missing while others are there: that layer runs at 1.0",
            _NEURON,
        ),
        (
            "SCALE-FOREIGN-NAME",
            ERROR,
            "only under a name Neuron ignores (kv_scale, k_proj.output_scale, ...)",
            _NEURON,
        ),
        (
            "SCALE-SHAPE",
            ERROR,
            "shape [] (loader IndexError) or more than one element (reshape)",
            _NEURON,
        ),
        (
            "SCALE-VALUE",
            ERROR,
            "non-finite, zero, negative, or 1/s not finite non-zero in bf16",
            _NEURON,
        ),
        (
            "SCALE-ALL-ZERO",
            ERROR,
            "every k_scale (or v_scale) is 0.0: one finding naming the layers",
            _NEURON,
        ),
        ("SCALE-UNREADABLE", ERROR, "the scale's bytes cannot be read", _NEURON),
        (
            "SCALE-IMPLAUSIBLE",
            WARNING,
            "above 64 (|x| <= 1 becomes an FP8 subnormal) or below 1e-6",
            _NEURON,
        ),
        ("SCALE-DTYPE", WARNING, "not float32", _NEURON),
        ("SCALE-UNCALIBRATED", WARNING, "every scale is exactly 1.0 (the same as none)", _NEURON),
        (
            "SCALE-NONE",
            "warning; error when a kv_cache_scheme is declared",
            "no KV scales at all",
            _NEURON,
        ),
        (
            "SCALE-NO-KV-SCHEME",
            _NOT_GPU,
            "scales but no kv_cache_scheme (GPU vLLM does not load them)",
            _GPU,
        ),
        (
            "SCALE-LAYER-COUNT",
            WARNING,
            "no usable num_hidden_layers: checks the layers the scales name",
            _NEURON,
        ),
        ("SCALE-EXTRA-LAYER", WARNING, "scales for layers the model does not have", _NEURON),
        (
            "SCALE-HEADS",
            ERROR,
            "--target gpu, attn_head: a per-head scale of the wrong count or value",
            _GPU,
        ),
        ("SCALE-Q-UNUSED", INFO, "q_scale on Neuron: not consumed by the plugin today", _NEURON),
        (
            "SCALE-Q-MISSING",
            WARNING,
            "--target gpu: FP8 attention declared, a layer has no q_scale (1.0)",
            _GPU,
        ),
        (
            "SCALE-Q-SHAPE",
            ERROR,
            "--target gpu: a q_scale of the wrong size for the kv_cache_scheme",
            _GPU,
        ),
        ("SCALE-Q-VALUE", ERROR, "--target gpu: a q_scale not finite and > 0", _GPU),
    ),
    "Checkpoint integrity (both Neuron loader variants)": (
        ("CKPT-NO-SAFETENSORS", ERROR, "no *.safetensors file and no index", _FILES),
        (
            "CKPT-HEADER",
            ERROR,
            "a safetensors header does not parse (truncated, oversized, ...)",
            _FILES,
        ),
        (
            "CKPT-INDEX-UNREADABLE",
            ERROR,
            "the index is not JSON, or its weight_map is not an object",
            _FILES,
        ),
        (
            "CKPT-INDEX-FILE-NAME",
            ERROR,
            "weight_map names a file that is not a bare *.safetensors name",
            _FILES,
        ),
        ("CKPT-INDEX-FILE-MISSING", ERROR, "weight_map names a file that does not exist", _FILES),
        ("CKPT-INDEX-KEY-UNMAPPED", _BY_KEY, "a key in a file but not in weight_map", _FILES),
        ("CKPT-INDEX-KEY-STALE", _BY_KEY, "weight_map points at a file that lacks the key", _FILES),
        ("CKPT-DUPLICATE-KEY", ERROR, "one key in two files", _FILES),
        (
            "CKPT-TOTAL-SIZE",
            WARNING,
            "metadata.total_size is not the sum of the mapped tensors' bytes",
            _FILES,
        ),
        (
            "CKPT-SINGLE-FILE-SHADOWS-INDEX",
            WARNING,
            "a model.safetensors beside an index (transformers reads it only)",
            "transformers PreTrainedModel.from_pretrained",
        ),
        (
            "CKPT-MXFP4-PAIR",
            ERROR,
            "an MXFP4 `_blocks` tensor without its `_scales` (or the reverse)",
            _GPT_OSS,
        ),
    ),
    "FP8 range and provenance": (
        (
            "RANGE-TARGET-MISMATCH",
            "error when sized for a larger FP8 max than the target's; info when smaller",
            "scales sized for another FP8 max than the target's",
            _OURS,
        ),
        (
            "RANGE-CLIPPED-UNSCORED",
            WARNING,
            "clipped scales not scored on the target's numerics (`scored_on`)",
            _OURS,
        ),
        (
            "RANGE-PROVENANCE-DISAGREES",
            WARNING,
            "the tensors (or the two records) disagree with the provenance",
            _OURS,
        ),
        ("RANGE-PROVENANCE-MALFORMED", WARNING, "unreadable provenance", _OURS),
        ("RANGE-UNKNOWN", INFO, "scales present, no provenance: FP8 max unknown", _OURS),
        (
            "OUTLIER-K-CHANNELS",
            WARNING,
            "k_proj biases put near-constant K channels high in an absmax range",
            _OURS,
        ),
        (
            "OUTLIER-K-UNKNOWN",
            INFO,
            "kvcalib sized the scales by absmax, no k_proj bias to probe",
            _OURS,
        ),
        (
            "CALIB-TOKENS-NOT-AS-SERVED",
            WARNING,
            "calibrated without the special tokens (BOS) vLLM adds to prompts",
            f"tokenizer.json TemplateProcessing; {_OURS}",
        ),
    ),
    "Portability": (
        (
            "KV-OBSERVER",
            WARNING,
            "kv_cache_scheme's observer is not the whole set's maximum",
            "llm-compressor 0.14 llmcompressor/observers/min_max.py, mse.py",
        ),
        (
            "PORT-KV-SCHEME-INVALID",
            ERROR,
            "kv_cache_scheme does not parse as QuantizationArgs",
            _ARGS,
        ),
        ("PORT-KV-SCHEME-FORMAT", ERROR, "not num_bits 8, type float, symmetric", _ARGS),
        (
            "PORT-KV-SCHEME-STRATEGY",
            "error; on --target gpu warning (info for static attn_head)",
            'strategy not "tensor" or dynamic not false',
            f"{_ARGS}; {_NEURON}",
        ),
        (
            "PORT-ATTENTION-GROUP",
            WARNING,
            "--target gpu: an FP8-attention group vLLM does not recognise",
            _GPU,
        ),
        ("PORT-CONFIG-GROUPS-MISSING", _NOT_GPU, "compressed-tensors without config_groups", _GPU),
        (
            "PORT-NO-SCALE-LOADER",
            "warning; info on --target gpu",
            "scales on a model without a Neuron scale loader",
            "vllm-project/vllm-neuron vllm_neuron/model/registry.py, qwen3_moe/factory.py",
        ),
        (
            "PORT-COMPRESSION-CONFIG",
            WARNING,
            "the 2024 key compression_config, not quantization_config",
            _BOTH,
        ),
        (
            "PORT-MXFP4-GPU",
            ERROR,
            "--target gpu: MXFP4 experts (GPU vLLM's MXFP4 config loads no KV scales)",
            "vllm-project/vllm vllm/model_executor/layers/quantization/mxfp4.py",
        ),
        (
            "PORT-VLLM-DROPS-SCALES",
            ERROR,
            "--target gpu: a vLLM release whose own loader drops this architecture's k_scale or v_scale",
            "vllm-project/vllm vllm/model_executor/models/*.py, run by scripts/vllm_scales_table.py",
        ),
        (
            "PORT-MXFP4-NEURON",
            INFO,
            "trn2/trn3: MXFP4 experts kept as released, and how Neuron serves them",
            _GPT_OSS,
        ),
        (
            "PORT-TRN3-KV-PATH",
            INFO,
            "--target trn3: which KV path uses the scales (per-tensor FP8, packed or not) and which none (MXFP8)",
            "aws-neuron/nki-library@092a49d experimental/attention_mxfp8/attention_mxfp8_tkg_torch.py; "
            "jinhuang12/vllm-neuron@ed3580d vllm_neuron/model/llama3/model_mx_fp8.py",
        ),
    ),
}
RULES = {group: tuple(Rule(*row) for row in rows) for group, rows in _ROWS.items()}
RULE = {rule.code: rule for rules in RULES.values() for rule in rules}
