"""Near-constant outlier K channels under scales sized by absmax (a cheap probe, no model run, no torch).

A k_proj bias in a RoPE pair that barely rotates puts a K channel at a constant; where that is a large part of the
k_scale's range, absmax scaling puts it on a coarse part of the FP8 grid and rounding flips it from token to token.
kvcalib's attention objective clips such channels; other checkpoints get a warning naming layer, head and channels.
"""

from __future__ import annotations

import math
from typing import Any

from kvcalib.core.checkpoint import CheckpointFiles, read_values
from kvcalib.core.errors import KvcalibError
from kvcalib.core.fp8 import get_target
from kvcalib.core.schema import head_counts, head_dim, neuron_scale_key, num_hidden_layers, text_config
from kvcalib.validation.files import read_provenance
from kvcalib.validation.report import INFO, WARNING, Finding

__all__ = ["OUTLIER_SHARE", "outlier_findings"]

OUTLIER_SHARE = 0.25  # a bias this share of the k_scale's range (or more) is an outlier channel
STILL_RADIANS = 0.25  # a RoPE pair that turns less than this over STILL_POSITIONS barely rotates
STILL_POSITIONS = 1024


def still_channels(config: dict[str, Any], size: int) -> set[int]:
    """The channels of the RoPE pairs that turn less than STILL_RADIANS over STILL_POSITIONS positions."""
    text = text_config(config)
    rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 1:
        theta = 10000.0
    half = size // 2
    still = {i for i in range(half) if STILL_POSITIONS * float(theta) ** (-2.0 * i / size) < STILL_RADIANS}
    return still | {i + half for i in still}


def _objective(scan: CheckpointFiles) -> str | None:
    provenance = read_provenance(scan)
    return provenance.get("scale_objective") if provenance else None


def outlier_findings(config: dict[str, Any], scan: CheckpointFiles, values: dict[str, float], prefix: str,
                     target: str) -> list[Finding]:
    """Warnings for near-constant outlier K channels sized by absmax (see the module docstring)."""
    objective = _objective(scan)
    if not values or objective == "attention":
        return []  # nothing to size, or kvcalib's attention objective already weighed every layer's clip
    kv_heads, layers, size = head_counts(config)["k"], num_hidden_layers(config), head_dim(config)
    if not (kv_heads and size is not None and size > 1 and layers):
        return []
    still, fp8_max, found, probed = still_channels(config, size), get_target(target).fp8_max, [], False
    for layer in range(layers):
        key = f"{prefix}.{layer}.self_attn.k_proj.bias"
        header, scale = scan.header_of(key), values.get(neuron_scale_key(layer, "k", prefix))
        if header is None or scale is None or not scale > 0 or header.tensors[key].nbytes > 4 * 65536:
            continue
        try:
            bias = read_values(header, key)
        except KvcalibError:
            continue
        probed = True
        limit = OUTLIER_SHARE * scale * fp8_max
        for head in range(min(kv_heads, len(bias) // size)):
            channels = [(c, bias[head * size + c]) for c in sorted(still)
                        if math.isfinite(bias[head * size + c]) and abs(bias[head * size + c]) >= limit]
            if channels:
                found.append((layer, head, channels, scale * fp8_max))
    if found:
        shown = "; ".join(
            f"layer {layer} KV head {head}: channels {', '.join(str(c) for c, _ in channels[:6])} at |K| "
            f"{min(abs(b) for _, b in channels):.4g}-{max(abs(b) for _, b in channels):.4g} of {span:.4g}"
            for layer, head, channels, span in found[:3])
        return [Finding(
            "OUTLIER-K-CHANNELS", WARNING,
            f"k_proj biases put near-constant K channels (RoPE pairs that barely rotate) at a large part of the "
            f"range the k_scale is sized for, in {len(found)} layer/head(s): {shown}. Scales sized by absmax put "
            f"such channels on a coarse part of the FP8 grid, where rounding flips them from token to token",
            "measure it with `kvcalib eval CKPT --dataset DATA` (its attention error per layer), or recalibrate "
            "with `kvcalib calibrate` (the attention objective clips such channels)",
            f"{prefix}.{found[0][0]}.self_attn.k_proj.bias")]
    if probed or objective != "absmax":
        return []
    return [Finding(  # kvcalib sized these by absmax on request: say what it could not check
        "OUTLIER-K-UNKNOWN", INFO,
        "near-constant outlier K channels (which make absmax-sized scales the worst choice) cannot be seen "
        "without running the model: no k_proj bias to probe",
        "`kvcalib eval CKPT --dataset DATA` reports each layer's attention-output error")]
