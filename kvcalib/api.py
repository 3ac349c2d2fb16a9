"""The public API: the jobs as the command line runs them (kvcalib.cli calls these same functions; see kvcalib).

What the CLI reads from the machine is read here unless given: the host CPU, the memory this process may use, the
temporary directory, the torchrun rank and the environment servers inherit. Every options field passes through as a
keyword; importing this module loads no torch."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.calibration.options import CalibrateOptions, CalibrationResult
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.core.mxfp4 import dequantize_mxfp4
from kvcalib.core.progress import ProgressCallback

if TYPE_CHECKING:
    from kvcalib.calibration.plan import CalibrationPlan
    from kvcalib.evaluation.context import ContextResult
    from kvcalib.evaluation.needle import NeedleResult
    from kvcalib.evaluation.options import EvalOptions, TaskOptions
    from kvcalib.evaluation.pipeline import EvalResult
    from kvcalib.evaluation.tasks import TaskResult
    from kvcalib.serving.options import ServeOptions
    from kvcalib.serving.pipeline import ServeCheckResult, ServeEvent
    from kvcalib.validation.report import ValidationReport

__all__ = [
    "calibrate",
    "calibrate_options",
    "dequantize_mxfp4",
    "eval_options",
    "evaluate",
    "evaluate_context",
    "evaluate_needle",
    "evaluate_tasks",
    "plan",
    "plan_serve_check",
    "run_calibration",
    "serve_calibrated",
    "serve_check",
    "serve_options",
    "task_options",
    "validate",
]

logger = logging.getLogger("kvcalib")


def _logged(result: Any) -> Any:
    for note in result.warnings:
        logger.warning("%s", note)
    return result


def calibrate_options(**fields: Any) -> CalibrateOptions:
    """CalibrateOptions as the CLI makes them, what it reads from the machine read unless given."""
    from kvcalib.calibration.ranks import Ranks
    from kvcalib.hf.memory import available_memory

    fields.setdefault("cpu", HostCpu.detect())
    fields.setdefault("memory", available_memory())
    fields.setdefault("scratch_dir", Path(tempfile.gettempdir()))
    fields.setdefault("ranks", Ranks.from_env(os.environ))
    return CalibrateOptions(**fields)


def plan_serve_check(
    model: str | Path, calibration: CalibrateOptions, device: str, **serve: Any
) -> ServeOptions:
    """`--serve-check DEVICE`: serve-check's options, all but the scales checked before calibrating."""
    from kvcalib.calibration.recipe import plan_recipe
    from kvcalib.hf.model import resolve_model_dir, resolve_target
    from kvcalib.serving.pipeline import check_serving
    from kvcalib.serving.preflight import check_strategy, validate_target

    serve.setdefault("memory_bytes", calibration.memory.available if calibration.memory else None)
    options = serve_options(device, **serve)
    options.check_arguments()
    plan = plan_recipe(
        calibration.recipe, calibration.target, calibration.engine, calibration.strategy
    )
    sized_for, served_on = resolve_target(plan.target), resolve_target(validate_target(device))
    check_strategy(plan.strategy, device)
    if sized_for.fp8_max > served_on.fp8_max:
        raise UsageError(
            f"--target {sized_for.name} sizes the scales for FP8 max {sized_for.fp8_max:g}, but "
            f"{device} clamps at {served_on.fp8_max:g}: serve-check would refuse the result",
            hint=f"calibrate with --target {served_on.name} for --serve-check {device}",
        )
    check_serving(resolve_model_dir(model), options)
    return options


def run_calibration(
    model: str | Path,
    dataset: str,
    output: str | Path,
    options: CalibrateOptions,
    progress: ProgressCallback | None = None,
) -> CalibrationResult:
    """The calibration itself (kvcalib.calibration.pipeline), its notes logged."""
    from kvcalib.calibration.pipeline import calibrate as run

    return _logged(run(model, dataset, output, options, progress=progress))


def serve_calibrated(
    result: CalibrationResult,
    serving: ServeOptions,
    progress: Callable[[ServeEvent], None] | None = None,
) -> CalibrationResult:
    """serve-check on the checkpoint calibrate just wrote (figures into the model card); sets `.serve_check`."""
    from kvcalib.calibration.card import summarize, write_card

    served = serve_check(result.output, options=serving, progress=progress)
    write_card(Path(result.output), summarize(result.validation), serve=served.to_dict())
    return dataclasses.replace(result, serve_check=served)


def plan(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    options: CalibrateOptions | None = None,
    progress: ProgressCallback | None = None,
    **fields: Any,
) -> CalibrationPlan:
    """`kvcalib calibrate ... --plan` (kvcalib.calibration.plan); `fields`: as for `calibrate`."""
    from kvcalib.calibration.plan import plan_calibration

    return plan_calibration(
        model, dataset, output, options or calibrate_options(**fields), progress=progress
    )


def calibrate(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    serve_check: str | None = None,
    serve: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    serve_progress: Callable[[ServeEvent], None] | None = None,
    **options: Any,
) -> CalibrationResult:
    """`kvcalib calibrate`: an FP8-KV checkpoint of `model` at `output`, scales from `dataset`; the CalibrationResult.
    CalibrateOptions fields pass through; serve_check: a device to serve the result on (`serve`: ServeOptions)."""
    calibration = calibrate_options(**options)
    serving = (
        None
        if serve_check is None
        else plan_serve_check(model, calibration, serve_check, **(serve or {}))
    )
    result = run_calibration(model, dataset, output, calibration, progress)
    return result if serving is None else serve_calibrated(result, serving, serve_progress)


def validate(
    path: str | Path, *, target: str = DEFAULT_TARGET, strict: bool = False
) -> ValidationReport:
    """`kvcalib validate`: the Neuron platform's config rules and kvcalib's checks; the ValidationReport (no torch)."""
    from kvcalib.validation.pipeline import validate_checkpoint

    return validate_checkpoint(Path(path), target, strict=strict)


def eval_options(*, compare: Sequence[str] = (), **fields: Any) -> EvalOptions:
    """EvalOptions as the CLI makes them, with the host CPU read unless given."""
    from kvcalib.evaluation.options import EvalOptions

    fields.setdefault("cpu", HostCpu.detect())
    return EvalOptions(compare=tuple(compare), **fields)


def task_options(
    tasks: Sequence[str], *, compare: Sequence[str] = (), **fields: Any
) -> TaskOptions:
    """TaskOptions as the CLI makes them (lm-eval tasks by name; limit, num_fewshot, task_data, ...)."""
    from kvcalib.evaluation.options import TaskOptions

    return TaskOptions(tasks=tuple(tasks), compare=tuple(compare), **fields)


def evaluate(
    checkpoint: str | Path,
    dataset: str,
    *,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
    **fields: Any,
) -> EvalResult:
    """`kvcalib eval --dataset`: FP8-KV accuracy on held-out text against the unquantised cache (compare: "unit"
    or other checkpoints); EvalOptions fields pass through, or `options` made already."""
    from kvcalib.evaluation.pipeline import evaluate as run

    return run(str(checkpoint), dataset, options or eval_options(**fields), progress=progress)


def evaluate_context(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    nll: bool = True,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
    **fields: Any,
) -> ContextResult:
    """`kvcalib eval --context L,...`: K/V saturation and ΔNLL (nll) per length and layer."""
    from kvcalib.evaluation.context import evaluate_context as run

    return run(
        str(checkpoint),
        dataset,
        tuple(lengths),
        options or eval_options(**fields),
        progress=progress,
        nll=nll,
    )


def evaluate_needle(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    keys: int | None = None,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
    **fields: Any,
) -> NeedleResult:
    """`kvcalib eval --context L,... --needle`: keys found per length and depth, per scale set."""
    from kvcalib.evaluation.needle import evaluate_needle as run

    return run(
        str(checkpoint),
        dataset,
        tuple(lengths),
        options or eval_options(**fields),
        keys,
        progress=progress,
    )


def evaluate_tasks(
    checkpoint: str | Path,
    tasks: Sequence[str],
    *,
    options: TaskOptions | None = None,
    progress: ProgressCallback | None = None,
    **fields: Any,
) -> TaskResult:
    """`kvcalib eval --tasks`: lm-eval tasks under the chip's FP8-KV numerics, paired item by item."""
    from kvcalib.evaluation.tasks import evaluate_tasks as run

    return run(str(checkpoint), options or task_options(tasks, **fields), progress=progress)


def serve_options(device: str, **fields: Any) -> ServeOptions:
    """ServeOptions as the CLI makes them: the environment, CPU flags and memory read unless given."""
    from kvcalib.hf.memory import available_memory
    from kvcalib.serving.options import ServeOptions

    fields.setdefault("env", dict(os.environ))
    fields.setdefault("cpu", HostCpu.detect(with_capability=False))
    if "memory_bytes" not in fields:
        fields["memory_bytes"] = available_memory().available
    return ServeOptions(device=device, **fields)


def serve_check(
    checkpoint: str | Path,
    *,
    device: str = "cpu",
    options: ServeOptions | None = None,
    progress: Callable[[ServeEvent], None] | None = None,
    **fields: Any,
) -> ServeCheckResult:
    """`kvcalib serve-check`: serve `checkpoint` with vLLM's FP8 KV cache, probe it, compare with a baseline, always
    stop the servers; the ServeCheckResult. ServeOptions fields pass through, or `options` made already."""
    from kvcalib.serving.pipeline import serve_check as run

    return _logged(
        run(Path(checkpoint), options or serve_options(device, **fields), progress=progress)
    )
