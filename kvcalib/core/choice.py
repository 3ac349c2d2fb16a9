"""The record of the scale objective's choice for one layer's K or V: calibrate's `layers[].k.choice` (--json
and the provenance it writes) and what eval reads back from that provenance (`layers[].chosen`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ScaleChoice"]


@dataclass(frozen=True)
class ScaleChoice:
    """label: the candidate ("absmax", "absmax x0.5", "1.0", "per head", ...); clipped: the fraction of the sampled
    elements it saturates on the target; attention_error, attention_error_absmax, attention_error_unit: the held-out
    relative attention-output error ||ΔO|| / ||O|| of the choice, of absmax and of 1.0 on the target;
    attention_error_on: the choice's on each server it was scored for, target first. Eval reads back the label. A
    field left None is not recorded."""

    label: str
    clipped: float | None = None
    attention_error: float | None = None
    attention_error_absmax: float | None = None
    attention_error_unit: float | None = None
    attention_error_on: tuple[tuple[str, float], ...] | None = None

    OMIT_NONE = True
