"""FP8 numerics: chip targets, the scale convention, and the chip-faithful quantiser.

Pure numerics: imports nothing else from kvcalib.

The one scale convention used everywhere (vLLM, compressed-tensors, the Neuron plugin):

    x ≈ fp8 * s          s = absmax / fp8_max

`s` is the dequantisation multiplier. Kernels that multiply by the reciprocal compute it
themselves; it is never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """A serving target: the largest finite FP8 value its KV cache saturates at."""

    name: str
    fp8_max: float
    description: str


# The one place that knows the chips. TRN2's FP8 E4M3 keeps inf/NaN encodings, so its
# largest finite value is 240 (the Neuron plugin clamps to ±240); TRN3 and GPUs use OCP
# E4M3FN with 448.
TARGETS: dict[str, Target] = {
    "trn2": Target("trn2", 240.0, "AWS Trainium 2 (FP8 E4M3, max 240)"),
    "trn3": Target("trn3", 448.0, "AWS Trainium 3 (OCP E4M3FN, max 448)"),
    "gpu": Target("gpu", 448.0, "vLLM on GPU/CPU (OCP E4M3FN, max 448)"),
}

DEFAULT_TARGET = "trn2"

# A layer whose K or V is exactly zero on every calibration token would get s = 0, which
# the Neuron loader turns into an infinite reciprocal. Floor the scale instead: any positive
# scale represents zeros exactly, and 1/SCALE_FLOOR is finite in bf16.
SCALE_FLOOR = 1e-8


def get_target(name: str) -> Target:
    """The target called `name`; ValueError naming the known ones otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        known = ", ".join(sorted(TARGETS))
        raise ValueError(f"unknown target {name!r}; known targets: {known}") from None


def scale_from_absmax(absmax: torch.Tensor | float, fp8_max: float) -> torch.Tensor:
    """Per-tensor symmetric scale(s) `absmax / fp8_max` as float32, floored at SCALE_FLOOR.

    Works element-wise, so a vector of per-layer absmax gives a vector of scales.
    """
    absmax = torch.as_tensor(absmax, dtype=torch.float32)
    return torch.clamp(absmax / fp8_max, min=SCALE_FLOOR)


def implied_fp8_max(absmax: float, scale: float) -> float:
    """The FP8 max a scale was sized for, given the absmax it came from."""
    return absmax / scale


def bf16_reciprocal_ok(scale: float) -> bool:
    """Whether the Neuron plugin's `bf16(1 / bf16(s))` is finite and non-zero."""
    s_bf16 = torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16)
    if not torch.isfinite(s_bf16) or s_bf16 == 0:
        return False
    r = (1.0 / s_bf16.float()).to(torch.bfloat16)
    return bool(torch.isfinite(r)) and bool(r != 0)
