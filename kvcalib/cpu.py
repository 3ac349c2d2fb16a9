"""The host CPU: its feature flags, what they allow, and bf16 at float32 speed where bf16 matmul is slow.

Pure: imports nothing else from kvcalib, and reads nothing from the machine by itself. The
CLI reads `/proc/cpuinfo` (or the `KVCALIB_CPU_FLAGS` override) and torch's CPU capability
and passes a `HostCpu` in, so a test can describe any other machine.

Why it matters: on x86 CPUs without AVX512-BF16 or AMX (AVX2-only AMD EPYC, many CI
runners and laptops) a bf16 `F.linear` runs about 7x slower than float32, and a bf16
calibration 3.4x slower than a float32 one. `bf16_via_float32()` runs the bf16 model's
matmuls and attention in float32, rounding to bf16 exactly where the bf16 model rounds:
bf16 inputs (upcast exactly), float32 accumulation, the result rounded once to bf16. Every
other op (norms, rotary embedding, activations, the K/V kvcalib records) stays the bf16
model's own. Weights stay in memory at their stored size; a weight is upcast only for the
call that uses it, in row blocks of at most `UPCAST_BLOCK_ELEMENTS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Native bf16 dot products: x86 AVX512-BF16 or AMX-BF16; Arm's "bf16" feature.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# vLLM's CPU backend keeps an FP8 KV cache only on x86 with AVX-512 or AMX.
VLLM_FP8_KV_FLAGS = ("avx512f", "amx_tile")
# torch CPU capabilities under which oneDNN's bf16 kernels are not used (ATEN_CPU_CAPABILITY can force one).
_SLOW_CAPABILITIES = frozenset({"DEFAULT", "NO AVX", "AVX2"})

BF16_COMPUTE_CHOICES = ("auto", "native", "float32")
NATIVE = "native"
FLOAT32 = "float32"

# A weight is upcast for one call in row blocks of at most this many elements (64 MiB in float32).
UPCAST_BLOCK_ELEMENTS = 16 << 20


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str] | None:
    """The `flags` (x86) or `Features` (Arm) of the first processor in /proc/cpuinfo text; None if absent."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


@dataclass(frozen=True)
class HostCpu:
    """What kvcalib needs to know of the CPU it runs on."""

    flags: frozenset[str] | None  # None: unknown (no /proc/cpuinfo)
    capability: str = "unknown"  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, ...
    source: str = "/proc/cpuinfo"  # where the flags came from

    @classmethod
    def from_cpuinfo(cls, path: Path, capability: str = "unknown", override: str | None = None) -> HostCpu:
        """Flags from `path` (a /proc/cpuinfo), or from `override` (space-separated flags) when given."""
        if override is not None:
            return cls(frozenset(override.replace(",", " ").split()), capability, "KVCALIB_CPU_FLAGS")
        try:
            flags = parse_cpu_flags(Path(path).read_text(errors="replace"))
        except OSError:
            flags = None
        return cls(flags, capability, str(path))

    @property
    def native_bf16(self) -> bool | None:
        """Whether bf16 matmul runs natively (fast); None when the flags are unknown."""
        if self.capability in _SLOW_CAPABILITIES:
            return False
        if self.flags is None:
            return None
        return bool(self.flags & NATIVE_BF16_FLAGS)

    @property
    def vllm_fp8_kv(self) -> bool | None:
        """Whether vLLM's CPU backend can keep an FP8 KV cache here; None when the flags are unknown."""
        return None if self.flags is None else any(flag in self.flags for flag in VLLM_FP8_KV_FLAGS)

    def describe(self) -> str:
        if self.flags is None:
            return f"CPU flags unknown ({self.source} unreadable), torch capability {self.capability}"
        shown = sorted(self.flags & (NATIVE_BF16_FLAGS | {"avx2", "avx512f", "amx_tile"})) or ["no AVX2"]
        return f"CPU {' '.join(shown)} (from {self.source}), torch capability {self.capability}"


@dataclass(frozen=True)
class ComputePath:
    """How a run computes: `float32` means bf16 matmuls run in float32 with bf16 rounding."""

    bf16_matmul: str  # "native" | "float32"
    reason: str

    @property
    def emulated(self) -> bool:
        return self.bf16_matmul == FLOAT32

    def describe(self) -> str:
        what = ("bf16 model, matmuls and attention in float32 with bf16 rounding" if self.emulated
                else "native matmuls in the model's dtype")
        return f"{what} ({self.reason})"


def choose_compute(requested: str, dtype: torch.dtype, device: torch.device, cpu: HostCpu | None) -> ComputePath:
    """The compute path for a model in `dtype` on `device`; ValueError for an unknown `requested`."""
    if requested not in BF16_COMPUTE_CHOICES:
        raise ValueError(f"unknown bf16 compute {requested!r}; use one of {', '.join(BF16_COMPUTE_CHOICES)}")
    if dtype != torch.bfloat16:
        return ComputePath(NATIVE, f"the model runs in {str(dtype).removeprefix('torch.')}")
    if device.type != "cpu":
        return ComputePath(NATIVE, f"bf16 on {device}")
    if requested != "auto":
        return ComputePath(requested, f"--bf16-compute {requested}")
    native = cpu.native_bf16 if cpu is not None else None
    if native is None:
        return ComputePath(NATIVE, "CPU not known: assumed to have native bf16 matmul")
    if native:
        return ComputePath(NATIVE, f"{cpu.describe()}: native bf16 matmul")
    return ComputePath(FLOAT32, f"{cpu.describe()}: no native bf16 matmul (needs avx512_bf16 or amx_bf16)")


@contextmanager
def compute_path(path: ComputePath) -> Iterator[None]:
    """Run the block on `path`: bf16_via_float32() when emulated, as is otherwise."""
    if not path.emulated:
        yield
        return
    with bf16_via_float32():
        yield


def bf16_via_float32() -> TorchFunctionMode:
    """A torch function mode: bf16 matmuls and attention computed in float32, rounded to bf16 once."""
    return _Bf16ViaFloat32()


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with bf16 inputs in float32, the weight upcast in row blocks (no float32 copy of it kept)."""
    xf = x.float()
    rows = max(1, UPCAST_BLOCK_ELEMENTS // max(1, weight.shape[-1]))
    if weight.shape[0] <= rows:
        return torch.nn.functional.linear(xf, weight.float(), _up(bias)).to(torch.bfloat16)
    parts = [
        torch.nn.functional.linear(xf, weight[i:i + rows].float(), None if bias is None else bias[i:i + rows].float())
        .to(torch.bfloat16)
        for i in range(0, weight.shape[0], rows)
    ]
    return torch.cat(parts, dim=-1)


# Query rows per block of the emulated attention: bounds its float32 scores to [B, H, 256, S].
SDPA_QUERY_BLOCK = 256


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """SDPA on bf16 inputs as torch's CPU flash-attention kernel computes it, with float32 matmuls.

    That kernel forms the scores in float32, takes exp(score - row max) in float32, sums it in
    float32, rounds the exponentials to bf16 for the product with V (float32 accumulation),
    divides by the sum and rounds the output to bf16 once. Copying those roundings keeps the
    emulated hidden states (and so the next layers' K/V) closest to the native bf16 model's.
    """
    if dropout_p:
        raise ValueError("kvcalib's float32 attention does not implement dropout")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_len, kv_len = query.shape[-2], key.shape[-2]
    kf_t, vf = key.float().transpose(-1, -2), value.float()
    blocks = []
    for start in range(0, q_len, SDPA_QUERY_BLOCK):
        stop = min(q_len, start + SDPA_QUERY_BLOCK)
        scores = (query[..., start:stop, :].float() @ kf_t) * scale  # [B, H, q, kv] float32
        if is_causal:
            rows = torch.arange(start, stop, device=query.device)[:, None]
            scores = scores.masked_fill(torch.arange(kv_len, device=query.device)[None, :] > rows, float("-inf"))
        if attn_mask is not None:
            block_mask = attn_mask[..., start:stop, :] if attn_mask.shape[-2] == q_len else attn_mask
            scores = (scores.masked_fill(~block_mask, float("-inf")) if block_mask.dtype == torch.bool
                      else scores + block_mask.float())
        row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # a fully masked row: zeros
        exp = torch.exp(scores - row_max)
        total = exp.sum(dim=-1, keepdim=True)
        out = (exp.to(torch.bfloat16).float() @ vf) / total
        blocks.append(out.nan_to_num(nan=0.0).to(torch.bfloat16))
    return torch.cat(blocks, dim=-2)


_F = torch.nn.functional
_UPCAST_OPS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
    torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.einsum,
})


class _Bf16ViaFloat32(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _F.linear and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bfloat16:
            return _linear(*args, **kwargs)
        if func is _F.scaled_dot_product_attention and _any_bf16(args[:3]):
            return _sdpa(*args, **kwargs)
        if func in _UPCAST_OPS and _any_bf16(args):
            out = func(*(_up_all(a) for a in args), **{k: _up_all(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
        return func(*args, **kwargs)


def _any_bf16(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


def _up_all(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_up(a) for a in x)
    return _up(x)
