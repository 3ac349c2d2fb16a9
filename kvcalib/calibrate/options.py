"""What calibrate takes (CalibrateOptions) and what it returns (CalibrationResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.calibrate.ranks import Ranks
from kvcalib.core.errors import UsageError, check_at_least
from kvcalib.hf.memory import MemoryLimit
from kvcalib.hf.model import RunOptions

__all__ = ["CalibrateOptions", "CalibrationResult", "KindScales", "LayerScales"]


@dataclass(frozen=True)
class CalibrateOptions(RunOptions):
    target: str | None = None  # None: the recipe's kvcalib.target, else fp8.DEFAULT_TARGET
    num_samples: int = 512
    max_seq_len: int = 2048
    batch_size: int = 4
    overwrite: bool = False
    engine: str = "auto"  # "auto": "stream" when the weights would not fit in memory, else "native"
    recipe: str | None = None  # an llm-compressor recipe whose kv_cache_scheme to use (calibrate.recipe)
    strategy: str | None = None  # "tensor" or "attn_head" (per KV head; gpu only); None: the recipe's, else tensor
    attention_scales: bool = False  # also observe Q and write q_scale + the FP8-attention config group
    scale_objective: str = "attention"  # "attention" (kvcalib.calibrate.objective) or "absmax" (never clip)
    headroom: float = 1.0  # K/V scales that clip nothing sized for headroom x absmax (long context; see calibrate.scales)
    extra_provenance: dict[str, Any] = field(default_factory=dict)
    ranks: Ranks | None = None  # set under torchrun: this process's share; only rank 0 writes
    # The machine, as the CLI reads it; None: read from /proc and /sys, TMPDIR.
    memory: MemoryLimit | None = None  # the host memory this process may use
    scratch_dir: Path | None = None  # where the stream engine spills hidden states

    def check_arguments(self) -> None:
        """The numbers a user passes, checked before anything is read (UsageError naming the flag)."""
        check_at_least("--num-samples", self.num_samples, 1, what="rows of the dataset to calibrate on")
        check_at_least("--max-seq-len", self.max_seq_len, 1, what="tokens per sample")
        check_at_least("--batch-size", self.batch_size, 1, what="sequences per forward pass")
        if not 1.0 <= self.headroom <= 16.0:
            raise UsageError(f"--headroom {self.headroom:g}: must be between 1 (none) and 16",
                             hint="e.g. --headroom 1.4142 (a square root of 2) for contexts far longer than the samples")
        if self.scale_objective not in ("attention", "absmax"):
            raise UsageError(f"unknown --scale-objective {self.scale_objective!r}",
                             hint="use attention (the default: the scales that keep attention right) or absmax "
                                  "(absmax / fp8_max, never clipping, as llm-compressor sizes them)")


@dataclass(frozen=True)
class KindScales:
    """One layer's K, V or Q: what was observed and the scale written. With strategy attn_head, head_absmax and
    head_scales hold every head's (KV heads for K/V, attention heads for Q); scale is their max (vLLM reports it)."""

    absmax: float
    scale: float
    key: str  # the tensor written (core.schema.scale_key)
    head_absmax: tuple[float, ...] | None = None
    head_scales: tuple[float, ...] | None = None
    range: float | None = None  # |x| the scale maps to the FP8 max (absmax unless the objective or --headroom chose)
    choice: dict[str, Any] | None = None  # K/V: the scale objective's choice and what the alternatives cost

    def to_dict(self, key: bool = True) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if v is not None and (key or k != "key")}


@dataclass(frozen=True)
class LayerScales:
    """One layer's scales, per kind: `{"layer": 0, "k": {...}, "v": {...}, "q": {...}}` in to_dict."""

    layer: int
    k: KindScales
    v: KindScales
    q: KindScales | None = None  # with attention scales (FP8 attention)

    def kinds(self) -> dict[str, KindScales]:
        return {kind: s for kind, s in (("k", self.k), ("v", self.v), ("q", self.q)) if s is not None}

    def to_dict(self, keys: bool = True) -> dict[str, Any]:
        """keys=False: without the tensor names (the provenance's form)."""
        return {"layer": self.layer, **{kind: s.to_dict(keys) for kind, s in self.kinds().items()}}


@dataclass(frozen=True)
class CalibrationResult:
    output: str
    model: str
    target: str
    fp8_max: float
    num_samples: int
    num_tokens: int
    layers: tuple[LayerScales, ...]
    seconds: float
    observe_seconds: float
    warnings: tuple[str, ...] = ()
    validation: dict[str, Any] | None = None
    compute: str = ""  # the compute path (core.cpu.ComputePath.describe())
    scale_objective: str = "absmax"
    objective_seconds: float = 0.0  # the scale objective's search, after observing
    serve_check: Any = None  # with --serve-check: serve-check's result (kvcalib.serve.ServeCheckResult)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.observe_seconds if self.observe_seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "model": self.model,
            "target": self.target,
            "fp8_max": self.fp8_max,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "compute": self.compute,
            "scale_objective": self.scale_objective,
            "objective_seconds": round(self.objective_seconds, 3),
            "layers": [layer.to_dict() for layer in self.layers],
            "warnings": list(self.warnings),
            "validation": self.validation,
        }
