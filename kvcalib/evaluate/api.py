"""`kvcalib.evaluate(...)` and its variants: eval as the command line runs it (kvcalib/__init__.py lists the API).

The host CPU is read from the machine unless given (`cpu=`), so bf16 on a CPU without native bf16 matmuls takes
the float32 path as the CLI's does; the CLI calls these same functions. Every EvalOptions (or TaskOptions)
field passes through as a keyword.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.core.cpu import HostCpu
from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.core.progress import ProgressCallback

if TYPE_CHECKING:
    from kvcalib.evaluate.context import ContextResult
    from kvcalib.evaluate.needle import NeedleResult
    from kvcalib.evaluate.pipeline import EvalOptions, EvalResult
    from kvcalib.evaluate.tasks import TaskOptions, TaskResult

__all__ = ["eval_options", "evaluate", "evaluate_context", "evaluate_needle", "evaluate_tasks", "task_options"]


def eval_options(*, target: str = DEFAULT_TARGET, compare: Sequence[str] = (), **fields: Any) -> EvalOptions:
    """EvalOptions as the CLI makes them, with the host CPU read unless given."""
    from kvcalib.evaluate.pipeline import EvalOptions

    fields.setdefault("cpu", HostCpu.detect())
    return EvalOptions(target=target, compare=tuple(compare), **fields)


def task_options(tasks: Sequence[str], *, target: str = DEFAULT_TARGET, compare: Sequence[str] = (),
                 **fields: Any) -> TaskOptions:
    """TaskOptions as the CLI makes them (lm-eval tasks by name; limit, num_fewshot, task_data, ...)."""
    from kvcalib.evaluate.tasks import TaskOptions

    return TaskOptions(tasks=tuple(tasks), target=target, compare=tuple(compare), **fields)


def evaluate(checkpoint: str | Path, dataset: str, *, target: str = DEFAULT_TARGET, compare: Sequence[str] = (),
             options: EvalOptions | None = None, progress: ProgressCallback | None = None, **fields: Any) -> EvalResult:
    """FP8-KV accuracy on held-out text with the chip's numerics against the unquantised cache (`kvcalib eval
    --dataset`): ΔNLL, KL and top-1, paired intervals, per layer. compare: "unit" (every scale 1.0) or other
    checkpoints whose scales to run too. Other EvalOptions fields: num_samples, max_seq_len, layer_rows, ...;
    `options`: EvalOptions made already (eval_options')."""
    from kvcalib.evaluate.pipeline import evaluate as run

    options = options or eval_options(target=target, compare=compare, **fields)
    return run(str(checkpoint), dataset, options, progress=progress)


def evaluate_context(checkpoint: str | Path, dataset: str, lengths: Sequence[int], *, target: str = DEFAULT_TARGET,
                     compare: Sequence[str] = (), nll: bool = True, options: EvalOptions | None = None,
                     progress: ProgressCallback | None = None, **fields: Any) -> ContextResult:
    """`kvcalib eval --context L,...`: per length and layer the K/V saturation and absmax past the scales, and
    (nll, else --saturation-only) ΔNLL on each sample's last quarter."""
    from kvcalib.evaluate.context import evaluate_context as run

    options = options or eval_options(target=target, compare=compare, **fields)
    return run(str(checkpoint), dataset, tuple(lengths), options, progress=progress, nll=nll)


def evaluate_needle(checkpoint: str | Path, dataset: str, lengths: Sequence[int], *, keys: int | None = None,
                    target: str = DEFAULT_TARGET, compare: Sequence[str] = (), options: EvalOptions | None = None,
                    progress: ProgressCallback | None = None, **fields: Any) -> NeedleResult:
    """`kvcalib eval --context L,... --needle`: keys found per length and depth, per scale set, paired against the
    unquantised cache."""
    from kvcalib.evaluate.needle import evaluate_needle as run

    options = options or eval_options(target=target, compare=compare, **fields)
    return run(str(checkpoint), dataset, tuple(lengths), options, keys, progress=progress)


def evaluate_tasks(checkpoint: str | Path, tasks: Sequence[str], *, target: str = DEFAULT_TARGET,
                   compare: Sequence[str] = (), options: TaskOptions | None = None,
                   progress: ProgressCallback | None = None, **fields: Any) -> TaskResult:
    """`kvcalib eval --tasks`: lm-eval tasks under the chip's FP8-KV numerics, each scale set paired item by item
    against the unquantised cache. Other TaskOptions fields: limit, num_fewshot, task_data, include_path, ..."""
    from kvcalib.evaluate.tasks import evaluate_tasks as run

    options = options or task_options(tasks, target=target, compare=compare, **fields)
    return run(str(checkpoint), options, progress=progress)
