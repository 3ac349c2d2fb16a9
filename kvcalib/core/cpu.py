"""The host CPU: its feature flags, what they allow, and so which compute path a bf16 model takes.

A `HostCpu` is passed in (`HostCpu.detect` reads /proc/cpuinfo or $KVCALIB_CPU_FLAGS), so a test can describe any
machine. Without AVX512-BF16 or AMX a bf16 `F.linear` runs ~7x slower than float32: `choose_compute` picks float32."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FLOAT32", "NATIVE", "ComputePath", "HostCpu", "choose_compute", "parse_cpu_flags"]

# Native bf16 dot products: x86 AVX512-BF16 or AMX-BF16; Arm's "bf16" feature.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# vLLM's CPU backend keeps an FP8 KV cache only on x86 with AVX-512 or AMX.
VLLM_FP8_KV_FLAGS = frozenset({"avx512f", "amx_tile"})
# torch CPU capabilities under which oneDNN's bf16 kernels are not used (ATEN_CPU_CAPABILITY can force one).
_SLOW_CAPABILITIES = frozenset({"DEFAULT", "NO AVX", "AVX2"})
NATIVE, FLOAT32 = "native", "float32"


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
    def from_cpuinfo(
        cls, path: Path, capability: str = "unknown", override: str | None = None
    ) -> HostCpu:
        """Flags from `path` (a /proc/cpuinfo), or from `override` (space-separated flags) when given."""
        if override is not None:
            return cls(
                frozenset(override.replace(",", " ").split()), capability, "KVCALIB_CPU_FLAGS"
            )
        try:
            return cls(
                parse_cpu_flags(Path(path).read_text(errors="replace")), capability, str(path)
            )
        except OSError:
            return cls(None, capability, str(path))

    @classmethod
    def detect(cls, with_capability: bool = True) -> HostCpu:
        """The CPU this runs on: /proc/cpuinfo's flags, or $KVCALIB_CPU_FLAGS; torch's capability too."""
        capability = "unknown"
        if with_capability:  # imports torch
            import torch

            capability = torch.backends.cpu.get_cpu_capability()
        return cls.from_cpuinfo(
            Path("/proc/cpuinfo"), capability, os.environ.get("KVCALIB_CPU_FLAGS")
        )

    @property
    def native_bf16(self) -> bool | None:
        """Whether bf16 matmul runs natively (fast); None when the flags are unknown."""
        if self.capability in _SLOW_CAPABILITIES:
            return False
        return None if self.flags is None else bool(self.flags & NATIVE_BF16_FLAGS)

    @property
    def vllm_fp8_kv(self) -> bool | None:
        """Whether vLLM's CPU backend can keep an FP8 KV cache here; None when the flags are unknown."""
        return None if self.flags is None else bool(self.flags & VLLM_FP8_KV_FLAGS)

    def describe(self) -> str:
        if self.flags is None:
            return (
                f"CPU flags unknown ({self.source} unreadable), torch capability {self.capability}"
            )
        shown = sorted(self.flags & (NATIVE_BF16_FLAGS | VLLM_FP8_KV_FLAGS | {"avx2"}))
        return f"CPU {' '.join(shown or ['no AVX2'])} (from {self.source}), torch capability {self.capability}"


@dataclass(frozen=True)
class ComputePath:
    """How a run computes: `float32` means bf16 matmuls run in float32 with bf16 rounding."""

    bf16_matmul: str  # "native" | "float32"
    reason: str

    @property
    def emulated(self) -> bool:
        return self.bf16_matmul == FLOAT32

    def describe(self) -> str:
        if self.emulated:
            return (
                f"bf16 model, matmuls and attention in float32 with bf16 rounding ({self.reason})"
            )
        return f"native matmuls in the model's dtype ({self.reason})"


def choose_compute(
    requested: str, dtype: torch.dtype, device: torch.device, cpu: HostCpu | None
) -> ComputePath:
    """The compute path for a model in `dtype` on `device` (`requested`: "auto" or the path, as --bf16-compute)."""
    import torch

    if dtype != torch.bfloat16:
        return ComputePath(NATIVE, f"the model runs in {str(dtype).removeprefix('torch.')}")
    if device.type != "cpu":
        return ComputePath(NATIVE, f"bf16 on {device}")
    if requested != "auto":
        return ComputePath(requested, f"--bf16-compute {requested}")
    native = None if cpu is None else cpu.native_bf16
    if native is None:
        return ComputePath(NATIVE, "CPU not known: assumed to have native bf16 matmul")
    if native:
        return ComputePath(NATIVE, f"{cpu.describe()}: native bf16 matmul")
    return ComputePath(
        FLOAT32, f"{cpu.describe()}: no native bf16 matmul (needs avx512_bf16 or amx_bf16)"
    )
