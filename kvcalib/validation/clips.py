"""RANGE-CLIPPED-UNSCORED: scales the scale objective clipped without scoring them on the target's numerics.

A scale sized for trn2 saturates at 240 x s there, and at 448 x s on trn3, GPU vLLM and vLLM CPU. A clip
chosen to saturate near-constant K channels on trn2 no longer saturates them at 448, and can put them on
rounding boundaries instead: a real Qwen2.5 1.5B checkpoint calibrated for trn2 by a kvcalib that scored
trn2 alone cost +1.96 nats served on vLLM CPU. kvcalib now scores every candidate on each server its
target's scales are for (core.fp8.served_numerics) and records them in the provenance (`scored_on`); a
record without `scored_on` was scored on its target alone.
"""

from __future__ import annotations

import math
from typing import Any

from kvcalib.core.schema import KV_KINDS
from kvcalib.validation.report import WARNING, Finding, short_repr

__all__ = ["clipped_unscored", "finite_number"]


def finite_number(value: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (a huge integer included)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def clipped_unscored(provenance: dict, where: str, target: str) -> list[Finding]:
    """The finding for `provenance`'s clipped layers (range below absmax) when `target` is not among the numerics it
    scored them on (`scored_on`; without it, the provenance's own target alone); [] otherwise."""
    layers, scored = provenance.get("layers"), provenance.get("scored_on")
    if not isinstance(layers, list):
        return []
    scored_on = scored if isinstance(scored, list) else [provenance.get("target")]
    if any(name == target for name in scored_on):
        return []
    clipped = []
    for entry in layers:
        if not isinstance(entry, dict):
            continue
        for kind in KV_KINDS:
            clip, absmax = finite_number(entry.get(f"{kind}_range")), finite_number(entry.get(f"{kind}_absmax"))
            if clip is not None and absmax is not None and 0 <= clip < absmax * (1 - 1e-6):
                clipped.append(f"layer {short_repr(entry.get('layer'))} {kind.upper()} at {clip / absmax:.2f} x absmax")
    if not clipped:
        return []
    scored_text = ", ".join(name[:24] if isinstance(name, str) else short_repr(name, 24) for name in scored_on[:4]) \
        + (", ..." if len(scored_on) > 4 else "")
    return [Finding(
        "RANGE-CLIPPED-UNSCORED", WARNING,
        f"the scale objective clipped {len(clipped)} scale(s) ({'; '.join(clipped[:3])}) scoring them on "
        f"{scored_text} only, not on {target}: where {target} saturates elsewhere, a clip chosen to saturate "
        "near-constant channels can put them on FP8 rounding boundaries instead",
        f"recalibrate with kvcalib calibrate --target {target}, or with a kvcalib that scores every server "
        "(its provenance lists them in scored_on)", where,
    )]
