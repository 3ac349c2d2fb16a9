"""RANGE-CLIPPED-UNSCORED: scales the scale objective clipped without scoring them on the target's numerics.

A clip chosen to saturate near-constant K channels at 240 (trn2) no longer saturates them at 448 (trn3, GPU, vLLM
CPU) and can put them on rounding boundaries. kvcalib records the numerics it scored on in the provenance
(`scored_on`, core.fp8.served_numerics); a record without it was scored on its target alone.
"""

from __future__ import annotations

import math
from typing import Any

from kvcalib.core.schema import KV_KINDS
from kvcalib.validation.report import WARNING, Finding, short_repr

__all__ = ["clipped_unscored", "finite_number", "provenance_kind"]


def provenance_kind(entry: dict, kind: str) -> dict:
    """One layer's K or V in kvcalib's provenance: `{"k": {"absmax": ...}}`, or flat `k_absmax` (before 0.2.0)."""
    nested = entry.get(kind)
    return nested if isinstance(nested, dict) else {n[2:]: v for n, v in entry.items() if n.startswith(f"{kind}_")}


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
    """The finding for clipped layers (range below absmax) when `target` is not among the numerics scored on."""
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
            record = provenance_kind(entry, kind)
            clip, absmax = finite_number(record.get("range")), finite_number(record.get("absmax"))
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
        "(its provenance lists them in scored_on)", where)]
