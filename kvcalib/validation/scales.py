"""The scales Neuron will read (SCALE-*): every layer's k_scale and v_scale, under the exact name it reads. Only the
scale tensors are read (a few bytes each); nothing here raises on anything a checkpoint can hold."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcalib.core import checkpoint
from kvcalib.core.checkpoint import CheckpointFiles
from kvcalib.core.errors import KvcalibError
from kvcalib.core.fp8 import DEFAULT_TARGET, TARGETS, bf16_reciprocal_ok, get_target
from kvcalib.core.schema import (
    ATTN_HEAD,
    KV_KINDS,
    NEURON_ALT_LAYERS_PREFIX,
    NEURON_LAYERS_PREFIX,
    head_counts,
    neuron_scale_key,
    num_hidden_layers,
    parse_foreign_scale_key,
    parse_scale_key,
)
from kvcalib.validation.config import QCFG_LOCATION, declared_kv_cache_scheme
from kvcalib.validation.heads import per_head_findings
from kvcalib.validation.report import ERROR, WARNING, Finding

__all__ = ["LARGEST_FP8_MAX", "ScaleCheck", "scale_findings"]

_SCALAR_CRASH = "IndexError: slice() cannot be applied to a 0-dim tensor."


@dataclass
class ScaleCheck:
    """What the scale rules learned, for provenance.py: the layer prefix and every well-formed scale's value."""

    prefix: str = NEURON_LAYERS_PREFIX
    values: dict[str, float] = field(default_factory=dict)
    present: bool = False  # any KV scale at all, under any name
    files: set[str] = field(default_factory=set)  # files holding Neuron-named scales
    target: str = DEFAULT_TARGET
    per_head: bool = False  # kv_cache_scheme strategy attn_head: one scale per KV head (GPU vLLM)
    heads: dict[str, int | None] = field(default_factory=dict)  # kind -> head count (config.json)
    zero: dict[str, list[int]] = field(
        default_factory=dict
    )  # kind -> the layers whose scale is 0.0


def scale_findings(
    config: dict[str, Any], scan: CheckpointFiles, target: str
) -> tuple[list[Finding], ScaleCheck]:
    """SCALE-*: every layer's k_scale and v_scale, under the exact name Neuron reads."""
    findings = []
    scheme = declared_kv_cache_scheme(config)
    scheme_declared = scheme is not None
    # the other loader's prefix where the keys are under it and none is a K/V scale under the usual one
    alt = any(k.startswith(NEURON_ALT_LAYERS_PREFIX + ".") for k in scan.key_files)
    usual = any(
        p and p[0] == NEURON_LAYERS_PREFIX and p[2] != "q"
        for p in map(parse_scale_key, scan.key_files)
    )
    check = ScaleCheck(
        prefix=NEURON_ALT_LAYERS_PREFIX if alt and not usual else NEURON_LAYERS_PREFIX,
        target=target,
        heads=head_counts(config),
        per_head=isinstance(scheme, dict) and scheme.get("strategy") == ATTN_HEAD,
    )
    own = {}
    foreign = {}
    for key in sorted(scan.key_files):
        parsed, other = parse_scale_key(key), parse_foreign_scale_key(key)
        if parsed and parsed[2] == "q" or not (parsed or other):
            continue
        if parsed and parsed[0] == check.prefix:  # (layer, kind) -> the key under the chosen prefix
            own[(parsed[1], parsed[2])] = key
            check.files.add(scan.file_of(key))
            continue
        # the right leaf name under a prefix Neuron does not read, or a name it does not read
        layer, only = parsed[1:] if parsed else other
        for kind in (only,) if only else KV_KINDS:
            foreign.setdefault((layer, kind), []).append(key)
    check.present = bool(own or foreign)
    if not check.present:
        return [
            Finding(
                "SCALE-NONE",
                ERROR if scheme_declared else WARNING,
                "no KV-cache scales in the checkpoint: not calibrated; with --kv-cache-dtype fp8 every "
                "layer runs with K and V scales 1.0"
                + (
                    " although quantization_config declares a kv_cache_scheme"
                    if scheme_declared
                    else ""
                ),
                "run kvcalib calibrate to write per-layer scales" + _unreadable(scan),
            )
        ], check
    n_layers = num_hidden_layers(config)
    layers = range(n_layers or 0)
    if n_layers is None:
        layers = sorted({layer for layer, _ in [*own, *foreign]})
        n_layers = layers[-1] + 1
        findings.append(
            Finding(
                "SCALE-LAYER-COUNT",
                WARNING,
                f"config.json has no usable num_hidden_layers: checked only the layers the "
                f"scales name ({_layer_list(layers)})",
                "the Neuron model needs num_hidden_layers (top level, or under text_config)",
                "config.json:num_hidden_layers",
            )
        )
    for layer in layers:
        for kind in KV_KINDS:
            findings += _check_one(
                scan, check, layer, kind, own.get((layer, kind)), foreign.get((layer, kind))
            )
    # SCALE-ALL-ZERO: every K (or V) scale 0.0 (an observer that never saw K or V), one error for all layers
    for kind in KV_KINDS:
        zero = check.zero.get(kind, [])
        if len(layers) < 2 or len(zero) < len(layers):
            continue
        names = {f"{check.prefix}.{layer}.self_attn.{kind}_scale" for layer in zero}
        findings = [
            f
            for f in findings
            if not (f.rule == "SCALE-VALUE" and f.location.rsplit(":", 1)[-1] in names)
        ]
        findings.append(
            Finding(
                "SCALE-ALL-ZERO",
                ERROR,
                f"every {kind}_scale is 0.0 (layers {_layer_list(zero)}): no {kind.upper()} was observed, and served "
                f"with FP8 KV every {kind.upper()} becomes inf or NaN (x / 0)",
                "recalibrate, e.g. `kvcalib calibrate`; with llm-compressor, check that its KV observer hooks this "
                "model's attention class (a non-zero scale on each layer)",
                f"{check.prefix}.*.self_attn.{kind}_scale",
            )
        )
    extra = sorted(key for (layer, _), key in own.items() if layer >= n_layers)
    if extra:
        findings.append(
            Finding(
                "SCALE-EXTRA-LAYER",
                WARNING,
                f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}: scale(s) for "
                f"layers the model does not have (num_hidden_layers = {n_layers}); they are never read",
                "check that the scales come from this model",
            )
        )
    values = check.values.values()
    if layers and len(values) == 2 * len(layers) and all(v == 1.0 for v in values):
        findings.append(
            Finding(
                "SCALE-UNCALIBRATED",
                WARNING,
                "every K and V scale is exactly 1.0: the checkpoint "
                "looks uncalibrated (the same as no scales)",
                "run kvcalib calibrate to measure real per-layer scales",
            )
        )
    if not scheme_declared and own:
        findings.append(
            Finding(
                "SCALE-NO-KV-SCHEME",
                WARNING if get_target(target).neuron else ERROR,
                "KV scales are present but quantization_config declares no kv_cache_scheme: "
                "GPU vLLM does not load them and runs FP8 KV with scales 1.0 "
                "(Neuron reads them with --kv-cache-dtype fp8)",
                "add the KV-only compressed-tensors quantization_config (kvcalib calibrate writes it)",
                QCFG_LOCATION,
            )
        )
    return findings, check


def _unreadable(scan: CheckpointFiles) -> str:
    n = len(scan.unreadable)
    return f"; {n} safetensors file(s) could not be read and may hold scales" if n else ""


def _layer_list(layers: list[int]) -> str:
    if len(layers) > 2 and layers[-1] - layers[0] + 1 == len(layers):  # sorted, distinct: a run
        return f"{layers[0]}..{layers[-1]}"
    return ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")


def _check_one(
    scan: CheckpointFiles,
    check: ScaleCheck,
    layer: int,
    kind: str,
    key: str | None,
    others: list[str] | None,
) -> list[Finding]:
    expected = neuron_scale_key(layer, kind, check.prefix)
    what = f"layer {layer}'s {kind.upper()} cache runs with scale 1.0 on Neuron (no error, no log line)"
    if key is None and others:
        return [
            Finding(
                "SCALE-FOREIGN-NAME",
                ERROR,
                f"found {', '.join(others)} but Neuron reads only {expected}: {what}",
                f"store the scale as {expected} (float32, shape [1])",
                f"{scan.file_of(others[0])}:{others[0]}",
            )
        ]
    if key is None:
        hint = "recalibrate, or add the missing scale (float32, shape [1])" + _unreadable(scan)
        return [Finding("SCALE-MISSING", ERROR, f"{expected} is missing: {what}", hint, expected)]
    header = scan.header_of(key)
    location, info = f"{header.path.name}:{key}", header.tensors[key]
    findings = []
    if info.dtype != "F32":
        findings.append(
            Finding(
                "SCALE-DTYPE",
                WARNING,
                f"{key} is {info.dtype}, not F32",
                "write scales as float32, shape [1]",
                location,
            )
        )
    if info.shape == ():
        return findings + [
            Finding(
                "SCALE-SHAPE",
                ERROR,
                f"{key} has shape [] (a 0-d scalar): the Neuron loader "
                f"crashes with {_SCALAR_CRASH}",
                "write the scale with shape [1]",
                location,
            )
        ]
    if check.per_head and not get_target(check.target).neuron:
        more, heads = per_head_findings(header, key, kind, check.heads.get(kind), location)
        if heads is not None:
            check.values[key] = max(heads)
            findings += _implausible(key, max(heads), location)
        return findings + more
    numel = math.prod(info.shape)
    if numel != 1:
        return findings + [
            Finding(
                "SCALE-SHAPE",
                ERROR,
                f"{key} has shape {list(info.shape)} ({numel} values, e.g. per-head): the Neuron loader's reshape "
                f"to [1, 1] crashes (RuntimeError: shape '[1, 1]' is invalid for input of size {numel})",
                "Neuron takes one per-tensor scale per layer: write float32, shape [1]"
                + (
                    "; per-head scales serve on GPU (kvcalib calibrate --target gpu --strategy attn_head)"
                    if check.per_head
                    else ""
                ),
                location,
            )
        ]
    try:
        value = checkpoint.read_values(header, key, 1)[0]
    except KvcalibError as exc:
        return findings + [Finding("SCALE-UNREADABLE", ERROR, exc.message, exc.hint, location)]
    if value == 0:
        check.zero.setdefault(kind, []).append(layer)
    problem = "not finite" if not math.isfinite(value) else "zero" if value == 0 else "negative"
    if math.isfinite(value) and value > 0 and bf16_reciprocal_ok(value):
        check.values[key] = value
        return findings + _implausible(key, value, location)
    return findings + [
        Finding(
            "SCALE-VALUE",
            ERROR,
            f"{key} = {value!r}: its reciprocal bf16(1 / bf16(s)), which Neuron stores, is not finite and non-zero"
            if math.isfinite(value) and value > 0
            else f"{key} = {value!r} is {problem}: a scale must be finite and > 0",
            "recalibrate; a scale must be positive (a layer that saw only zeros too) and within bf16's range",
            location,
        )
    ]


# Bounds outside which no real K or V needs the scale (above 2^6, |x| <= 1 falls below E4M3's smallest normal).
IMPLAUSIBLY_LARGE_SCALE = 64.0
IMPLAUSIBLY_SMALL_SCALE = 1e-6
LARGEST_FP8_MAX = max(
    t.fp8_max for t in TARGETS.values()
)  # OCP E4M3FN's 448: llm-compressor's and GPU vLLM's


def _implausible(key: str, value: float, location: str) -> list[Finding]:
    if IMPLAUSIBLY_SMALL_SCALE <= value <= IMPLAUSIBLY_LARGE_SCALE:
        return []
    if value > IMPLAUSIBLY_LARGE_SCALE:
        why = (
            f"above {IMPLAUSIBLY_LARGE_SCALE:g}, every K/V value of magnitude 1 or less becomes an FP8 "
            "subnormal (x / s < 2^-6) and loses its precision"
        )
    else:
        why = (
            f"below {IMPLAUSIBLY_SMALL_SCALE:g}, it is sized for an absmax under {value * LARGEST_FP8_MAX:.3g}, and "
            "every larger value saturates (a layer that saw only zeros while calibrating gets such a floor)"
        )
    return [
        Finding(
            "SCALE-IMPLAUSIBLE",
            WARNING,
            f"{key} = {value:.3g}: no real K/V needs this scale; {why}",
            "recalibrate it (kvcalib calibrate), or check the tool that wrote it",
            location,
        )
    ]
