"""What kvcalib's provenance says about the scales: the FP8 range they were sized for (RANGE-*), the clips the scale
objective chose, outlier K channels under absmax scales (OUTLIER-K-*), the calibration tokens (CALIB-TOKENS-*)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from kvcalib.core.checkpoint import CheckpointFiles, read_json, read_values
from kvcalib.core.errors import KvcalibError
from kvcalib.core.fp8 import (
    SCALE_FLOOR,
    SCALE_ROUNDING_TOLERANCE,
    TARGETS,
    get_target,
)
from kvcalib.core.schema import (
    KV_KINDS,
    PROVENANCE_FILENAME,
    PROVENANCE_METADATA_KEY,
    head_counts,
    head_dim,
    neuron_scale_key,
    num_hidden_layers,
    text_config,
)
from kvcalib.validation.report import ERROR, INFO, WARNING, Finding, short_repr
from kvcalib.validation.scales import LARGEST_FP8_MAX, ScaleCheck

__all__ = ["outlier_findings", "range_findings", "read_provenance", "token_findings"]


def _records(provenance: dict) -> list[tuple[Any, str, dict]]:
    """(layer, kind, record) for each K and V of the provenance's layers: `{"k": {"absmax": ...}}`, or flat `k_absmax`
    (before 0.2.0)."""
    layers = provenance.get("layers")
    return [
        (
            entry.get("layer"),
            kind,
            nested
            if isinstance(nested := entry.get(kind), dict)
            else {n[2:]: v for n, v in entry.items() if n.startswith(f"{kind}_")},
        )
        for entry in (layers if isinstance(layers, list) else ())
        if isinstance(entry, dict)
        for kind in KV_KINDS
    ]


def finite_number(value: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (a boolean or a huge integer included)."""
    try:
        return float(value) if type(value) in (int, float) and math.isfinite(value) else None
    except OverflowError:
        return None


def read_provenance(scan: CheckpointFiles) -> dict[str, Any] | None:
    """kvcalib_calibration.json as an object; None when absent or unreadable (range_findings reports a bad one)."""
    sources = _provenance_sources(scan, (), [])
    return sources[0][1] if sources else None


def range_findings(scan: CheckpointFiles, check: ScaleCheck, target: str) -> list[Finding]:
    """RANGE-*: the FP8 max the scales were sized for, from kvcalib's provenance, against the target."""
    if not check.present:
        return []
    findings = []
    sources, target_max = _provenance_sources(scan, check.files, findings), TARGETS[target].fp8_max
    if not sources:
        return findings + [
            Finding(
                "RANGE-UNKNOWN",
                INFO,
                "scales present, FP8 max unknown (no kvcalib provenance)"
                + (
                    f": scales sized as absmax/{LARGEST_FP8_MAX:g} (llm-compressor, GPU vLLM) clip every value "
                    f"above {target_max:g}/{LARGEST_FP8_MAX:g} ≈ {target_max / LARGEST_FP8_MAX:.2f} of a layer's "
                    f"absmax on {target}"
                    if target_max < LARGEST_FP8_MAX
                    else ""
                ),
                "recalibrate with kvcalib calibrate --target to be sure of the range",
            )
        ]
    (where, provenance), *rest = sources
    fp8_max = provenance.get("fp8_max")
    findings += [
        Finding(
            "RANGE-PROVENANCE-DISAGREES",
            WARNING,
            f"{where} says fp8_max {short_repr(fp8_max)}, {other_where} says {short_repr(other.get('fp8_max'))}",
            "recalibrate to get one consistent record",
            where,
        )
        for other_where, other in rest
        if other.get("fp8_max") != fp8_max
    ]
    if finite_number(fp8_max) is None or fp8_max <= 0:
        return findings + [
            _malformed_provenance(where, f"fp8_max is {short_repr(fp8_max)}, not a positive number")
        ]
    fp8_max = float(fp8_max)
    calibrated_for = provenance.get("target")
    sized = f"scales were sized for FP8 max {fp8_max:g}" + (
        f" (calibrated for {calibrated_for[:24]})" if isinstance(calibrated_for, str) else ""
    )
    larger = fp8_max > target_max * (1 + 1e-6)
    # clipped layers (range below absmax) when `target` is not among the numerics scored on (`scored_on`,
    # core.fp8.served_numerics; a record without it was scored on its target alone); larger: an error already
    scored = provenance.get("scored_on")
    scored_on = scored if isinstance(scored, list) else [provenance.get("target")]
    clipped = []
    for layer, kind, record in [] if larger or target in scored_on else _records(provenance):
        clip, absmax = finite_number(record.get("range")), finite_number(record.get("absmax"))
        if clip is not None and absmax is not None and 0 <= clip < absmax * (1 - 1e-6):
            clipped.append(
                f"layer {short_repr(layer)} {kind.upper()} at {clip / absmax:.2f} x absmax"
            )
    if larger or (
        fp8_max < target_max * (1 - 1e-6) and not clipped
    ):  # "safe" unless a clip was never scored
        findings.append(
            Finding(
                "RANGE-TARGET-MISMATCH",
                ERROR if larger else INFO,
                f"{sized}, but {target} saturates at {target_max:g}: values above "
                f"{target_max:g}/{fp8_max:g} ≈ {target_max / fp8_max:.2f} of each layer's absmax clip"
                if larger
                else f"{sized}; {target} saturates at {target_max:g}: safe, using {fp8_max:g}/{target_max:g} "
                f"≈ {fp8_max / target_max:.2f} of the FP8 range",
                f"recalibrate with kvcalib calibrate --target {target} "
                "(a trn2 checkpoint from kvcalib is chosen for 448-range servers too)"
                if larger
                else f"recalibrate with --target {target} for the full range",
                where,
            )
        )
    if clipped:  # RANGE-CLIPPED-UNSCORED
        scored_text = ", ".join(
            name[:24] if isinstance(name, str) else short_repr(name, 24) for name in scored_on[:4]
        ) + (", ..." if len(scored_on) > 4 else "")
        findings.append(
            Finding(
                "RANGE-CLIPPED-UNSCORED",
                WARNING,
                f"the scale objective clipped {len(clipped)} scale(s) ({'; '.join(clipped[:3])}) scoring them on "
                f"{scored_text} only, not on {target}: where {target} saturates elsewhere, a clip chosen to saturate "
                "near-constant channels can put them on FP8 rounding boundaries instead",
                f"recalibrate with kvcalib calibrate --target {target}, or with a kvcalib that scores every server "
                "(its provenance lists them in scored_on)",
                where,
            )
        )
    layers = provenance.get("layers")
    if layers is not None and not isinstance(layers, list):
        return findings + [
            _malformed_provenance(where, f"layers is {type(layers).__name__}, not a list")
        ]
    disagree = []
    for layer, kind, record in _records(provenance):
        key = neuron_scale_key(layer, kind, check.prefix) if type(layer) is int else None
        actual, recorded = check.values.get(key), finite_number(record.get("scale"))
        # what the scale was sized for: the range the scale objective chose, else the absmax
        absmax = finite_number(record.get("range", record.get("absmax"))) or 0.0
        if actual is None:
            continue
        if recorded is not None and abs(recorded - actual) > 1e-5 * max(recorded, actual):
            disagree.append(f"{key} is {actual:.6g}, provenance says {recorded:.6g}")
        # kvcalib rounds scales up by < SCALE_ROUNDING_TOLERANCE (bf16 grid, see fp8.py)
        elif (
            absmax > 0
            and actual > SCALE_FLOOR * 2
            and abs(absmax / actual - fp8_max) > SCALE_ROUNDING_TOLERANCE * fp8_max
        ):
            disagree.append(
                f"{key} = {actual:.6g} sized for {absmax:.6g} means FP8 max {absmax / actual:.6g}, "
                f"not {fp8_max:g}"
            )
    if disagree:
        findings.append(
            Finding(
                "RANGE-PROVENANCE-DISAGREES",
                WARNING,
                f"{len(disagree)} scale(s) disagree with the provenance in {where}: {'; '.join(disagree[:3])}",
                "the scales were edited after calibration; recalibrate, or trust neither",
                where,
            )
        )
    return findings


def _provenance_sources(
    scan: CheckpointFiles, files: Iterable[str], findings: list[Finding]
) -> list[tuple[str, dict]]:
    """The provenance file, then each of `files`' metadata record, that is a JSON object (findings for the rest)."""
    path, sources = scan.root / PROVENANCE_FILENAME, []
    try:
        sources += (
            [(PROVENANCE_FILENAME, read_json(path, "kvcalib provenance"))] if path.exists() else []
        )
    except KvcalibError as exc:
        findings.append(_malformed_provenance(PROVENANCE_FILENAME, exc.message))
    for name in sorted(files):
        raw = (scan.headers[name].metadata or {}).get(PROVENANCE_METADATA_KEY)
        if raw is None:
            continue
        where = f"{name}:__metadata__[{PROVENANCE_METADATA_KEY!r}]"
        try:
            sources.append((where, json.loads(raw)))
        except (ValueError, RecursionError) as exc:
            findings.append(_malformed_provenance(where, f"not valid JSON ({exc})"))
    findings += [
        _malformed_provenance(where, "not a JSON object")
        for where, data in sources
        if not isinstance(data, dict)
    ]
    return [(where, data) for where, data in sources if isinstance(data, dict)]


def _malformed_provenance(where: str, problem: str) -> Finding:
    return Finding(
        "RANGE-PROVENANCE-MALFORMED",
        WARNING,
        f"kvcalib provenance {where}: {problem}; FP8 max unknown",
        "recalibrate with kvcalib calibrate to rewrite it",
        where,
    )


OUTLIER_SHARE = 0.25  # a bias this share of the k_scale's range (or more) is an outlier channel
STILL_RADIANS = 0.25  # a RoPE pair that turns less than this over STILL_POSITIONS barely rotates
STILL_POSITIONS = 1024


def outlier_findings(
    config: dict[str, Any],
    scan: CheckpointFiles,
    check: ScaleCheck,
    target: str,
    provenance: dict[str, Any] | None,
) -> list[Finding]:
    """OUTLIER-K-*: a k_proj bias in a RoPE pair that barely rotates puts a K channel at a constant; sized by absmax,
    it sits on a coarse part of the FP8 grid, where rounding flips it from token to token (no model run, no torch)."""
    objective, values, prefix = (
        (provenance or {}).get("scale_objective"),
        check.values,
        check.prefix,
    )
    if not values or objective in ("attention", "output"):
        return []  # nothing to size, or kvcalib's scale objective already weighed every layer's clip
    kv_heads, layers, size = head_counts(config)["k"], num_hidden_layers(config), head_dim(config)
    if not (kv_heads and size is not None and size > 1 and layers):
        return []
    # the channels of the RoPE pairs that turn less than STILL_RADIANS over STILL_POSITIONS positions
    text = text_config(config)
    rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    theta = finite_number(rope.get("rope_theta", text.get("rope_theta"))) or 0.0
    theta, half = theta if theta > 1 else 10000.0, size // 2  # a huge integer is no theta either
    still = [i for i in range(half) if STILL_POSITIONS * theta ** (-2.0 * i / size) < STILL_RADIANS]
    still, fp8_max = still + [i + half for i in still], get_target(target).fp8_max
    found, probed = [], False
    for layer in range(layers):
        key = f"{prefix}.{layer}.self_attn.k_proj.bias"
        header, scale = scan.header_of(key), values.get(neuron_scale_key(layer, "k", prefix))
        if header is None or not (scale or 0) > 0 or header.tensors[key].nbytes > 4 * 65536:
            continue
        try:
            bias = read_values(header, key)
        except KvcalibError:
            continue
        probed = True
        limit = OUTLIER_SHARE * scale * fp8_max
        for head in range(min(kv_heads, len(bias) // size)):
            row = bias[head * size : (head + 1) * size]
            channels = [
                (c, row[c]) for c in still if math.isfinite(row[c]) and abs(row[c]) >= limit
            ]
            if channels:
                found.append((layer, head, channels, scale * fp8_max))
    if found:
        shown = "; ".join(
            f"layer {layer} KV head {head}: channels {', '.join(str(c) for c, _ in channels[:6])} at |K| "
            f"{min(abs(b) for _, b in channels):.4g}-{max(abs(b) for _, b in channels):.4g} of {span:.4g}"
            for layer, head, channels, span in found[:3]
        )
        return [
            Finding(
                "OUTLIER-K-CHANNELS",
                WARNING,
                f"k_proj biases put near-constant K channels (RoPE pairs that barely rotate) at a large part of the "
                f"range the k_scale is sized for, in {len(found)} layer/head(s): {shown}. Scales sized by absmax put "
                f"such channels on a coarse part of the FP8 grid, where rounding flips them from token to token",
                "measure it with `kvcalib eval CKPT --dataset DATA` (its attention error per layer), or recalibrate "
                "with `kvcalib calibrate` (the attention objective clips such channels)",
                f"{prefix}.{found[0][0]}.self_attn.k_proj.bias",
            )
        ]
    if probed or objective != "absmax":
        return []
    return [
        Finding(  # kvcalib sized these by absmax on request: say what it could not check
            "OUTLIER-K-UNKNOWN",
            INFO,
            "near-constant outlier K channels (which make absmax-sized scales the worst choice) cannot be seen "
            "without running the model: no k_proj bias to probe",
            "`kvcalib eval CKPT --dataset DATA` reports each layer's attention-output error",
        )
    ]


AS_SERVED = "as served"  # how the provenance's rule starts when rows were tokenised as vLLM does


def token_findings(scan: CheckpointFiles, provenance: dict[str, Any] | None) -> list[Finding]:
    """CALIB-TOKENS-NOT-AS-SERVED, from the provenance's `special_tokens`: scales measured without the special tokens
    (BOS) of the `single` template of tokenizer.json's TemplateProcessing, which vLLM's completions endpoint adds."""
    if provenance is None:
        return []
    rule = provenance.get("special_tokens")
    if isinstance(rule, str) and rule.startswith((AS_SERVED, "every row")):
        return []
    # the special tokens tokenizer.json's post-processor puts around a plain prompt (none if unknown)
    path, added = scan.root / "tokenizer.json", []
    try:
        post = read_json(path, "tokenizer").get("post_processor") if path.is_file() else None
    except (KvcalibError, AttributeError):
        post = None
    sequence = isinstance(post, dict) and post.get("type") == "Sequence"
    processors = post.get("processors") if sequence else [post]
    for processor in processors if isinstance(processors, list) else []:
        if isinstance(processor, dict) and processor.get("type") == "TemplateProcessing":
            for piece in processor.get("single") or []:
                special = piece.get("SpecialToken") if isinstance(piece, dict) else None
                if isinstance(special, dict) and isinstance(special.get("id"), str):
                    added.append(special["id"])
    if not added:
        return []
    how = (
        "with --no-add-special-tokens"
        if isinstance(rule, str)
        else "by a kvcalib that added no special tokens"
    )
    return [
        Finding(
            "CALIB-TOKENS-NOT-AS-SERVED",
            WARNING,
            f"the scales were measured on text without {', '.join(added)}, calibrated {how}, while vLLM adds "
            f"{'it' if len(added) == 1 else 'them'} to every completions prompt (tokenizer.json's post-processor): "
            "the server writes K/V the calibration never saw (the first position is the attention sink)",
            "recalibrate with `kvcalib calibrate` (its default tokenises as vLLM serves: plain text with the "
            "tokenizer's special tokens, chat-template text without)",
            PROVENANCE_FILENAME,
        )
    ]
