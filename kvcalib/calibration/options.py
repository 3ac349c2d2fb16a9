"""What calibrate takes (CalibrateOptions) and what it returns (CalibrationResult). Real annotations (no
`from __future__ import annotations`: kvcalib.core.options reads a field's type as it is); a type imported only under
TYPE_CHECKING is written as a string."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvcalib.core import fp8
from kvcalib.core.choice import ScaleChoice
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import UsageError
from kvcalib.core.options import RunOptions, check_options, option
from kvcalib.core.schema import KvCacheSize
from kvcalib.validation.report import ValidationReport

# Why the default budget: scripts/bench_tokens.py's study (scripts/BENCHMARKS.md, "How many calibration tokens")
TOKEN_STUDY = (
    "the fewest measured whose scales are within the noise of 1M tokens' (held-out ΔNLL, paired) on SmolLM2-135M, "
    "Gemma-3-270M and Qwen2.5-Coder-0.5B (kvcalib's token study)"
)

if TYPE_CHECKING:
    from kvcalib.calibration.ranks import Ranks
    from kvcalib.hf.data import CalibrationData
    from kvcalib.hf.memory import MemoryLimit
    from kvcalib.serving.pipeline import ServeCheckResult

__all__ = [
    "CalibrateOptions",
    "Engine",
    "Machine",
    "ScaleObjective",
    "Strategy",
    "CalibrationResult",
    "KindScales",
    "LayerScales",
]

Engine = Literal["auto", "native", "stream", "llmcompressor"]
Strategy = Literal["tensor", "attn_head"]
# "output" (an old spelling) is parsed only to be refused with its hint (check_arguments); --help does not list it
ScaleObjective = Literal["attention", "absmax", "output"]


@dataclass(frozen=True)
class CalibrateOptions(RunOptions):
    target: str | None = option(
        None,
        "Chip the scales are sized for: trn2 (FP8 max 240), trn3 or gpu (448). Default: the recipe's "
        "kvcalib.target, else trn2.",
        panel="Scales",
        short="-t",
        choices=lambda: tuple(fp8.TARGETS),
    )
    num_samples: int = option(
        32,
        "First N rows of the split. The default 32 x --max-seq-len 2048 (64k tokens) is the fewest measured whose "
        "scales are within the noise of 1M tokens' on three real models.",
        aliases=("--num-calibration-samples",),
        minimum=1,
        what="rows of the dataset to calibrate on",
    )
    max_seq_len: int = option(
        2048,
        "Tokens per sample at most.",
        aliases=("--max-seq-length",),
        minimum=1,
        what="tokens per sample",
    )
    batch_size: int = option(
        4,
        "Sequences per forward pass.",
        panel="Engine",
        minimum=1,
        what="sequences per forward pass",
    )
    max_memory: float | None = option(
        None,
        "GiB of host memory this run may use (as accelerate's max_memory): a model that does not fit streams "
        "layer by layer, and --plan sizes the run by it. Default: what is free.",
        panel="Engine",
        minimum=0,
        what="GiB",
        metavar="GIB",
    )
    overwrite: bool = option(False, "Replace OUTPUT if it exists.", panel="Output")
    engine: Engine = option(
        "auto",
        "auto: native, or stream when the weights would not fit; llmcompressor: llm-compressor's oneshot "
        "observes (pip install kvcalib\\[llmcompressor]).",
        panel="Engine",
    )
    recipe: str | None = option(
        None,
        "llm-compressor recipe whose kv_cache_scheme to use: a shipped one by name (trn2, trn3, gpu) or a "
        "YAML file.",
        panel="Scales",
        metavar="NAME|FILE",
    )
    strategy: Strategy | None = option(
        None,
        "tensor (one K and one V scale per layer) or attn_head (one per KV head; GPU only: vLLM on Neuron "
        "cannot load them). Default: the recipe's kv_cache_scheme, else tensor.",
        panel="Scales",
    )
    attention_scales: bool = option(
        False,
        "Also observe Q after RoPE (and q-norm) and write self_attn.q_scale with llm-compressor's "
        "FP8-attention config group (GPU vLLM's FP8 attention reads it; the Neuron plugin does not yet).",
        panel="Scales",
    )
    scale_objective: ScaleObjective = option(
        "attention",
        "attention: per layer, the scale whose attention block output (after o_proj) is closest to the "
        "unquantised one on every server the scales are for, clipping where that helps; absmax: absmax / FP8 "
        "max, never clipping (llm-compressor's rule).",
        panel="Scales",
        metavar="attention|absmax",
    )
    headroom: float = option(
        1.0,
        "K/V scales that clip nothing sized for this many times the absmax seen (1: none): room for "
        "contexts far longer than the samples, where absmax grows (e.g. 1.4142).",
        panel="Scales",
    )
    extra_provenance: dict[str, Any] = field(default_factory=dict)

    def check_arguments(self) -> None:
        """The values a user passes, checked before anything is read (UsageError naming the flag)."""
        if self.scale_objective == "output":
            raise UsageError(
                "--scale-objective output: not a choice; the default, attention, scores the attention "
                "block's output after o_proj",
                hint="use --scale-objective attention, or leave the flag out",
            )
        check_options(self)
        if not 1.0 <= self.headroom <= 16.0:
            raise UsageError(
                f"--headroom {self.headroom:g}: must be between 1 (none) and 16",
                hint="e.g. --headroom 1.4142 (a square root of 2) for contexts far longer than the "
                "samples",
            )

    def token_budget(self, data: "CalibrationData") -> str:
        """Why `data` has the tokens it has: the rows and length asked (with the defaults, what they rest on), and
        where the dataset gave less (fewer rows, empty rows, shorter rows)."""
        cls = type(self)
        asked = f"--num-samples {self.num_samples} x --max-seq-len {self.max_seq_len}"
        if (self.num_samples, self.max_seq_len) == (cls.num_samples, cls.max_seq_len):
            asked = f"the defaults, {asked}: {TOKEN_STUDY}"
        if data.num_tokens == self.num_samples * self.max_seq_len:
            return asked
        short = [f"the dataset gave {data.rows_selected} rows"] * (
            data.rows_selected < self.num_samples
        )
        short += [f"{data.rows_empty} rows empty"] * (data.rows_empty > 0)
        if data.num_tokens < len(data.sequences) * self.max_seq_len:
            short.append(f"rows average {data.num_tokens / len(data.sequences):,.0f} tokens")
        return f"asked {asked}; " + "; ".join(short)


@dataclass(frozen=True)
class Machine:
    """What a calibration reads from this machine, once (`Machine.read`), passed beside the options and never
    written into them: the host CPU, the memory this process may use (the tighter of what is free and --max-memory),
    torchrun's ranks (None outside torchrun; only rank 0 writes), where the stream engine spills hidden states."""

    cpu: HostCpu
    memory: "MemoryLimit"
    ranks: "Ranks | None"
    scratch_dir: Path | None  # None: the system's temporary directory

    @classmethod
    def read(
        cls,
        options: CalibrateOptions,
        cpu: HostCpu | None = None,
        memory: "MemoryLimit | None" = None,
        scratch_dir: Path | None = None,
    ) -> "Machine":
        """This machine as `options` limit it; what is given is taken as read (a test acts out another machine)."""
        from kvcalib.calibration.ranks import Ranks
        from kvcalib.hf.memory import GiB, MemoryLimit, available_memory

        memory = memory or available_memory()
        if options.max_memory is not None:
            cap = MemoryLimit(int(options.max_memory * GiB), f"--max-memory {options.max_memory:g}")
            memory = min(memory, cap, key=lambda m: m.available)
        return cls(
            cpu or HostCpu.detect(),
            memory,
            Ranks.from_env(os.environ),
            scratch_dir,
        )


@dataclass(frozen=True)
class KindScales:
    """One layer's K, V or Q: absmax (observed), scale (written: x ≈ fp8 * scale; per head, their max), key (the tensor:
    core.schema.scale_key); where set: head_absmax, head_scales (attn_head), range (|x| the scale maps to the FP8 max:
    absmax unless the objective or --headroom chose), choice (the scale objective's, and the others' cost)."""

    absmax: float
    scale: float
    key: str
    head_absmax: tuple[float, ...] | None = None
    head_scales: tuple[float, ...] | None = None
    range: float | None = None
    choice: ScaleChoice | None = None

    OMIT_NONE = True


@dataclass(frozen=True)
class LayerScales:
    """One layer's scales in CalibrationResult's layers: layer, k, v, q (KindScales; q with FP8 attention)."""

    layer: int
    k: KindScales
    v: KindScales
    q: KindScales | None = None

    OMIT_NONE = True


@dataclass(frozen=True)
class CalibrationResult:
    """What `calibrate` wrote; to_json() is its --json (with --serve-check, its "calibration", beside "serve_check": the
    ServeCheckResult in `serve_check`). output, model, target, fp8_max, num_samples, num_tokens, token_budget (why that
    many), seconds, tokens_per_s (of observing), objective_seconds (the scale objective's search), compute (the compute
    path), scale_objective, layers (LayerScales), warnings, validation (ValidationReport of what was written),
    kv_cache (KvCacheSize)."""

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
    validation: ValidationReport | None = None
    compute: str = ""
    scale_objective: str = "absmax"
    objective_seconds: float = 0.0
    serve_check: "ServeCheckResult | None" = None
    kv_cache: KvCacheSize | None = None
    token_budget: str = ""  # why num_tokens (CalibrateOptions.token_budget)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.observe_seconds if self.observe_seconds > 0 else float("nan")

    JSON = {"observe_seconds": None, "serve_check": None, "tokens_per_s": "tokens_per_s"}
