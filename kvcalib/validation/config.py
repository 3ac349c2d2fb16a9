"""validate's rules over config.json alone: the Neuron platform's validator (NEURON-QCFG-*), the Llama gate,
the portability of compressed-tensors configs (PORT-*, KV-OBSERVER). Takes raw JSON values of any type; never raises."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from kvcalib.core.fp8 import get_target
from kvcalib.core.schema import ATTN_HEAD, NEURON_PER_HEAD_REASON, parse_kv_scheme
from kvcalib.validation.report import ERROR, INFO, WARNING, Finding, short_repr

__all__ = [
    "QCFG_LOCATION",
    "declared_kv_cache_scheme",
    "llama_gate",
    "neuron_quantization_verdict",
    "portability_findings",
]

QCFG_LOCATION = "config.json:quantization_config"
VLLM_SCALES = Path(__file__).parent / "vllm_scales.json"  # scripts/vllm_scales_table.py writes it

# The Neuron platform's validator: jinhuang12/vllm-neuron@25cf3c8c00d5, vllm_neuron/vllm/platform.py,
# NeuronPlatform._validate_quantization_config; these are its words, so users can search for them.
PLATFORM_PREFIX = (
    "Neuron only supports compressed-tensors for KV cache quantization (q_scale/k_scale/v_scale)."
)
LLAMA_METHODS = ("modelopt", "compressed-tensors")

# The Llama architectures the Llama gate applies to (vllm_neuron/model/llama3/).
LLAMA_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# The families whose Neuron model reads the KV scales (_load_kv_cache_scales), per vllm-project/vllm-neuron:
# vllm_neuron/model/registry.py (Llama, GPT-OSS, Qwen3), vllm_neuron/model/qwen3_moe/factory.py (Qwen3-MoE);
# vllm_neuron/model/qwen3_5/ (qwen3_5, qwen3_5_moe) casts K/V to FP8 with no scale at all.
SCALE_LOADER_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
)
SCALE_LOADER_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "gpt_oss"})
UNSCALED_FP8_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
    }
    return names.get(type(value), "an object")


def _malformed(message: str, location: str, hint: str) -> Finding:
    return Finding("NEURON-QCFG-MALFORMED", ERROR, message, hint, location)


def _rejected(rule: str, what: str, group: str, hint: str | None = None) -> Finding:
    message = f"{PLATFORM_PREFIX} {what} in config_groups['{group}'] is not supported."
    return Finding(
        rule, ERROR, message, hint or _KV_ONLY_HINT, f"{QCFG_LOCATION}.config_groups['{group}']"
    )


_KV_ONLY_HINT = (
    "FP8 KV on Neuron is a KV-only compressed-tensors config: empty config_groups and a "
    "kv_cache_scheme (what `kvcalib calibrate` writes)"
)


# ModelOpt's quant_algo -> the quant_method vLLM sets from it; any other quant_algo raises there.
_MODELOPT_METHODS = {
    "FP8": "modelopt",
    "FP8_PER_CHANNEL_PER_TOKEN": "modelopt",
    "FP8_PB_WO": "modelopt",
    "NVFP4": "modelopt_fp4",
}


def vllm_quantization_config(qc: object) -> dict | Finding | None:
    """quantization_config as vLLM hands it on (None if absent), or the Finding where vLLM crashes or raises on it
    (vllm-project/vllm@00bb6f59a0c7, vllm/transformers_utils/model_arch_config_convertor.py,
    _normalize_quantization_config)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):  # vLLM calls quant_cfg.get(...) on anything but None, falsy or not
        return _malformed(
            f"quantization_config is {json_type(qc)}, not an object: vLLM crashes reading it "
            "(quant_cfg.get) before the Neuron platform can check it",
            QCFG_LOCATION,
            "make quantization_config a JSON object, or remove it",
        )
    producer, modelopt = qc.get("producer", {}), qc.get("quantization", {})
    if not isinstance(producer, dict):
        return _malformed(
            f"quantization_config.producer is {json_type(producer)}, not an object: vLLM crashes "
            "reading its name (producer.get)",
            f"{QCFG_LOCATION}.producer",
            'write producer as an object, e.g. {"name": "modelopt", "version": "0.31.0"}, or remove it',
        )
    if producer.get("name") == "modelopt" or (
        isinstance(modelopt, dict) and "modelopt_quant_config" in modelopt
    ):
        if not isinstance(modelopt, dict):
            return _malformed(
                f"quantization_config.quantization is {json_type(modelopt)}, not an object, with "
                "producer modelopt: vLLM crashes reading its quant_algo (quantization.get)",
                f"{QCFG_LOCATION}.quantization",
                'write quantization as an object such as {"quant_algo": "FP8"}, or remove producer',
            )
        algo = modelopt.get("quant_algo")
        if algo is not None:
            if str(algo).upper() not in _MODELOPT_METHODS:
                return Finding(
                    "NEURON-QCFG-MODELOPT-ALGO",
                    ERROR,
                    f"Unknown ModelOpt quant algo: {algo}. vLLM "
                    "knows FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO and NVFP4 only, and refuses the rest",
                    "re-export with a quant_algo vLLM knows; for kvcalib's KV-only scales remove producer "
                    "and quantization (quant_method compressed-tensors)",
                    f"{QCFG_LOCATION}.quantization",
                )
            qc = {**qc, "quant_method": _MODELOPT_METHODS[str(algo).upper()]}
    method = qc.get("quant_method", "")
    if not isinstance(method, str):
        return _malformed(
            f"quantization_config.quant_method is {json_type(method)}, not a string: vLLM crashes "
            "normalising it (quant_method.lower())",
            f"{QCFG_LOCATION}.quant_method",
            'write "quant_method": "compressed-tensors" for FP8 KV scales',
        )
    return {
        **qc,
        "quant_method": method.lower().replace("compressed_tensors", "compressed-tensors"),
    }


def neuron_quantization_verdict(
    quantization_config: object, neuron_config: dict | None = None
) -> Finding | None:
    """NeuronPlatform._validate_quantization_config (cited above) on the raw config.json value as vLLM normalises it;
    `neuron_config`: the serve command's additional_config["neuron_config"]. None when the platform accepts it."""
    qc = vllm_quantization_config(quantization_config)
    if not isinstance(qc, dict):
        return qc
    method = qc["quant_method"]
    if isinstance(neuron_config, dict) and neuron_config.get("quantization") == "mxfp8":
        return None
    if "mx" in method:
        return Finding(
            "NEURON-QCFG-MX",
            ERROR,
            f"Neuron does not support MX quantization: quant_method={method!r}. "
            "The Neuron matmul substrate has no MX path.",
            "use a checkpoint without MX weight quantization, or serve with "
            "additional_config neuron_config quantization 'mxfp8' (a CPU-dequant path)",
            f"{QCFG_LOCATION}.quant_method",
        )
    if method != "compressed-tensors":  # "fp8" included: accepted here, see the Llama gate
        return None
    groups = qc.get("config_groups", {})
    if not isinstance(groups, dict):
        return _malformed(
            f"quantization_config.config_groups is {json_type(groups)}, not an object: the "
            "Neuron platform crashes iterating it (config_groups.items())",
            f"{QCFG_LOCATION}.config_groups",
            'write "config_groups": {} for a KV-only checkpoint',
        )
    # each config group, as the platform checks it: weights, output activations, then input activations on
    # targets none of which contains "Attention" (in that order); the first refused is the verdict
    for name, group in groups.items():
        location = f"{QCFG_LOCATION}.config_groups['{name}']"
        if not isinstance(group, dict):
            return _malformed(
                f"config_groups['{name}'] is {json_type(group)}, not an object: the Neuron "
                "platform crashes reading it (group.get)",
                location,
                "each config group must be an object; remove this one for a KV-only checkpoint",
            )
        if group.get("weights"):
            return _rejected("NEURON-QCFG-WEIGHTS", "Weight quantization", name)
        if group.get("output_activations"):
            return _rejected("NEURON-QCFG-OUTPUT-ACT", "Output activation quantization", name)
        if not group.get("input_activations"):
            continue
        targets = group.get("targets", [])
        try:  # the platform's own test, run as it runs: its crash is a finding too
            if any("Attention" in t for t in targets):
                continue
        # targets not iterable, or a target `in` cannot test (substring, element or key membership)
        except TypeError:
            if not isinstance(targets, list):
                return _malformed(
                    f"config_groups['{name}'].targets is {json_type(targets)} while input_activations "
                    "is set: the Neuron platform crashes iterating it (TypeError)",
                    f"{location}.targets",
                    'write targets as a list of module names, e.g. ["LlamaAttention"]',
                )
            i = next(i for i, t in enumerate(targets) if not isinstance(t, (str, list, dict)))
            return _malformed(
                f"config_groups['{name}'].targets[{i}] is {json_type(targets[i])}, not a string: the Neuron "
                "platform crashes testing it for 'Attention' (TypeError)",
                f"{location}.targets[{i}]",
                "every target must be a string (a module class name or a re: pattern)",
            )
        hint = (
            _KV_ONLY_HINT
            if not isinstance(targets, str)
            else (
                f"targets is a string, which the platform reads character by character "
                f'and never matches; write a list such as ["LlamaAttention"]. {_KV_ONLY_HINT}'
            )
        )
        return _rejected(
            "NEURON-QCFG-INPUT-ACT",
            "Input activation quantization on non-attention targets",
            name,
            hint,
        )
    return None


def _architectures(config: dict[str, Any]) -> list[str]:
    archs = config.get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def _in_family(
    config: dict[str, Any], architectures: frozenset[str], model_types: frozenset[str]
) -> bool:
    model_type = config.get("model_type")
    return bool(architectures.intersection(_architectures(config))) or (
        isinstance(model_type, str) and model_type in model_types
    )


def llama_gate(config: dict[str, Any]) -> Finding | None:
    """The Neuron Llama model's own check at model build (vllm-neuron: vllm_neuron/model/llama3/,
    QuantizationSpec.from_hf_quantization_config: modelopt or compressed-tensors only)."""
    qc = config.get("quantization_config")
    if not _in_family(config, LLAMA_ARCHITECTURES, frozenset({"llama"})) or not qc:
        return None
    qc = vllm_quantization_config(qc)
    if not isinstance(qc, dict):
        return None  # vLLM fails first; NEURON-QCFG-MALFORMED reports it
    method = qc["quant_method"]
    if method in LLAMA_METHODS:
        return None
    return Finding(
        "NEURON-LLAMA-QUANT-METHOD",
        ERROR,
        f"Unsupported quantization_config.quant_method={method!r}. "
        "Llama3 currently supports: 'modelopt', 'compressed-tensors'.",
        "the Neuron Llama model fails at build with this config; for FP8 KV scales use "
        "quant_method 'compressed-tensors' with a kv_cache_scheme (kvcalib calibrate writes it)",
        f"{QCFG_LOCATION}.quant_method",
    )


def declared_kv_cache_scheme(config: dict[str, Any]) -> Any:
    """quantization_config.kv_cache_scheme, or None."""
    qc = config.get("quantization_config")
    return qc.get("kv_cache_scheme") if isinstance(qc, dict) else None


def portability_findings(
    config: dict[str, Any], target: str, scales_present: bool
) -> list[Finding]:
    """PORT-*: what GPU vLLM and compressed-tensors need, and what Neuron ignores."""
    findings = []
    qc, cc = config.get("quantization_config"), config.get("compression_config")
    cc_method = cc.get("quant_method", "") if isinstance(cc, dict) else None
    # vLLM normalises it in qc's place
    if qc is None and cc is not None and not isinstance(cc_method, str):
        what = (
            f"compression_config is {json_type(cc)}, not an object"
            if cc_method is None
            else (f"compression_config.quant_method is {json_type(cc_method)}, not a string")
        )
        findings.append(
            _malformed(
                f"{what}: vLLM crashes normalising it where quantization_config is absent",
                "config.json:compression_config",
                "rename compression_config to "
                'quantization_config, an object with "quant_method": "compressed-tensors"',
            )
        )
    elif qc is None and "compression_config" in config:
        findings.append(
            Finding(
                "PORT-COMPRESSION-CONFIG",
                WARNING,
                "config.json uses the 2024 key compression_config: GPU vLLM still reads it, but "
                "the Neuron platform and its Llama model look only at quantization_config",
                "rename compression_config to quantization_config",
                "config.json:compression_config",
            )
        )
    normalised = vllm_quantization_config(qc)
    if isinstance(normalised, dict) and normalised["quant_method"] == "compressed-tensors":
        if "config_groups" not in qc:
            findings.append(
                Finding(
                    "PORT-CONFIG-GROUPS-MISSING",
                    WARNING if get_target(target).neuron else ERROR,
                    "quantization_config has no config_groups: GPU vLLM's compressed-tensors loader "
                    "indexes it and fails with KeyError: 'config_groups'",
                    'add "config_groups": {} (empty for a KV-only checkpoint)',
                    QCFG_LOCATION,
                )
            )
        scheme = qc.get("kv_cache_scheme")
        if scheme is not None:
            # KV-OBSERVER: an observer that is not a whole-set maximum (or none named)
            observer = (
                scheme.get("observer")
                if isinstance(scheme, dict) and scheme.get("dynamic") is False
                else "static_minmax"
            )
            # a partial observer or none (static_minmax keeps the whole set's maximum; an unknown one: no finding)
            if observer is None or isinstance(observer, str) and observer in PARTIAL_OBSERVERS:
                what = (
                    _NO_OBSERVER
                    if observer is None
                    else f"records observer {observer!r}: {PARTIAL_OBSERVERS[observer]}"
                )
                findings.append(
                    Finding(
                        "KV-OBSERVER",
                        WARNING,
                        f"kv_cache_scheme {what}; K/V beyond those scales saturate in FP8",
                        "recalibrate with observer: static_minmax in the recipe's kv_cache_scheme (as kvcalib's "
                        "recipes/kv-fp8-trn2.yaml), or with `kvcalib calibrate`, which takes the whole set's absmax",
                        f"{QCFG_LOCATION}.kv_cache_scheme.observer",
                    )
                )
            if not _plain_fp8_scheme(
                scheme
            ):  # else nothing more: exactly what compressed-tensors' parse gives
                findings += _parsed_kv_scheme_findings(scheme, target)
    loaded = _in_family(
        config, SCALE_LOADER_ARCHITECTURES, SCALE_LOADER_MODEL_TYPES
    )  # by a Neuron KV-scale loader
    if (scales_present or declared_kv_cache_scheme(config) is not None) and not loaded:
        names = (
            ", ".join(_architectures(config))
            or f"model_type {short_repr(config.get('model_type'))}"
        )
        unscaled = _in_family(config, frozenset(), UNSCALED_FP8_MODEL_TYPES)
        findings.append(
            Finding(
                "PORT-NO-SCALE-LOADER",
                WARNING if get_target(target).neuron else INFO,
                f"{names}: the Neuron model casts K/V straight to FP8 with no scale and no clamp, so the scales are "
                "ignored and values beyond the FP8 range are not saturated"
                if unscaled
                else f"{names} has no Neuron KV-scale loader (only Llama, Qwen3 dense, Qwen3-MoE and GPT-OSS read "
                "them): on Neuron the scales are ignored and FP8 KV runs with scale 1.0",
                "serve this model on GPU, or expect uncalibrated FP8 KV on Neuron",
                "config.json:architectures",
            )
        )
    if target == "trn3" and scales_present and loaded:
        findings.append(
            Finding(
                "PORT-TRN3-KV-PATH",
                INFO,
                "on Trainium 3 vLLM Neuron keeps an FP8 KV cache per tensor (plain, or packed with "
                "neuron_config.fp8_packed_kv): these k_scale/v_scale are used there, clamped at ±448. An MXFP8 KV "
                "cache (AWS's attention_mxfp8_tkg: an E8M0 scale per 32 values) would use none of them; no public "
                "plugin release serves one (its MXFP8 is the weights')",
                "`kvcalib eval CKPT --target trn3 --order mxfp8` predicts the MXFP8 cache's cost",
                QCFG_LOCATION,
            )
        )
    if (
        target == "gpu" and scales_present
    ):  # vllm_scales.json: what each release's own loader did (or its source)
        findings += [
            Finding(
                "PORT-VLLM-DROPS-SCALES",
                ERROR,
                f"vLLM {version} serves this FP8 KV cache with {kind} 1.0: its loader drops {row['architecture']}'s",
                "serve it with a vLLM release that loads them (scripts/VLLM_SCALES.md), or without an FP8 KV cache",
                "config.json:architectures",
            )
            for version, release in json.loads(VLLM_SCALES.read_text()).items()
            for row in release["families"].values()
            if row["architecture"] in _architectures(config)
            for kind in ("k_scale", "v_scale")
            if row[kind] is False
        ]
    return findings


# The static per-tensor FP8 kv_cache_scheme, which compressed-tensors accepts as it stands: recognised without
# importing it (torch: 1.6 s of a 2 s validate); anything else is parsed by compressed-tensors itself.
_PLAIN_FP8_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor",
    "dynamic": False,
}


def _plain_fp8_scheme(scheme: Any) -> bool:
    return (
        isinstance(scheme, dict)
        and set(scheme) - {"observer"} == set(_PLAIN_FP8_SCHEME)
        and all(type(scheme[k]) is type(v) and scheme[k] == v for k, v in _PLAIN_FP8_SCHEME.items())
        and type(scheme.get("observer")) in (str, type(None))
    )


# What the observer a kv_cache_scheme records made of the scales (llm-compressor 0.14,
# llmcompressor/observers/min_max.py and mse.py): only static_minmax keeps the whole calibration set's maximum.
_LAST_BATCH = (
    "the last calibration batch's range only (each batch replaces the one before), so the scales "
    "come from one batch, not the whole set"
)
_MOVING_AVERAGE = (
    "a moving average of the per-batch ranges (llm-compressor's averaging_constant, 0.01 by "
    "default), not their maximum, so the scales sit below the largest K/V the set produced"
)
PARTIAL_OBSERVERS = {
    "memoryless_minmax": _LAST_BATCH,
    "memoryless_mse": _LAST_BATCH,
    "memoryless": _LAST_BATCH,
    "minmax": _MOVING_AVERAGE,
    "mse": _MOVING_AVERAGE,
}
_NO_OBSERVER = (
    "names no observer: llm-compressor 0.14 then observes K/V with minmax, "
    + _MOVING_AVERAGE
    + "; compressed-tensors versions that fill the field in (QuantizationArgs.validate_model_after) "
    "write memoryless_minmax, " + _LAST_BATCH
)


def _parsed_kv_scheme_findings(scheme: Any, target: str) -> list[Finding]:
    location = f"{QCFG_LOCATION}.kv_cache_scheme"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = parse_kv_scheme(scheme)
    except Exception as exc:  # noqa: BLE001 - third-party validation: any failure is a finding
        return [
            Finding(
                "PORT-KV-SCHEME-INVALID",
                ERROR,
                f"kv_cache_scheme does not parse as compressed-tensors QuantizationArgs: {exc}",
                "keep only num_bits, type, strategy, dynamic, symmetric, observer in kv_cache_scheme; "
                "put provenance elsewhere (unknown keys are refused)",
                location,
            )
        ]
    findings = []
    kind = str(getattr(args.type, "value", args.type))
    if args.num_bits != 8 or kind != "float" or not args.symmetric:
        findings.append(
            Finding(
                "PORT-KV-SCHEME-FORMAT",
                ERROR,
                f"kv_cache_scheme is num_bits={args.num_bits}, type={kind!r}, symmetric={args.symmetric}: "
                "FP8 KV needs num_bits 8, type 'float', symmetric true",
                "missing fields take compressed-tensors' defaults (int, 8 bits); write them out",
                location,
            )
        )
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == ATTN_HEAD and args.dynamic is False:
        neuron = get_target(target).neuron
        findings.append(
            Finding(
                "PORT-KV-SCHEME-STRATEGY",
                ERROR if neuron else INFO,
                f"kv_cache_scheme has strategy 'attn_head' (one scale per KV head), which {target} cannot serve: "
                f"{NEURON_PER_HEAD_REASON}"
                if neuron
                else "kv_cache_scheme has strategy 'attn_head' (one scale per KV head): GPU vLLM reads it on its "
                "FlashAttention backend only (other backends refuse per-head scales at startup)",
                "recalibrate per tensor for Neuron (kvcalib calibrate --target trn2 --strategy tensor)"
                if neuron
                else "serve it on GPU with FlashAttention",
                location,
            )
        )
    elif strategy != "tensor" or args.dynamic is not False:
        dynamic = getattr(args.dynamic, "value", args.dynamic)
        findings.append(
            Finding(
                "PORT-KV-SCHEME-STRATEGY",
                ERROR if get_target(target).neuron else WARNING,
                f"kv_cache_scheme has strategy={strategy!r}, dynamic={dynamic!r}: Neuron reads one static "
                "per-tensor scale per layer (strategy 'tensor', dynamic false)",
                "calibrate static per-tensor scales (kvcalib calibrate)",
                location,
            )
        )
    return findings
