"""The public API: the jobs as the command line runs them (kvcalib.cli calls these same functions; see kvcalib).

Each function takes its options class's fields as keywords, each declared once, in the class
(`CalibrateOptions.seed`), or the options made already (`options=`), not both. What the run reads from the machine
(the host CPU, memory, torchrun's ranks) is read where it is used, never written into the options; importing this
module loads no torch."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.calibration.options import CalibrateOptions, CalibrationResult, Machine
from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.core.progress import ProgressCallback
from kvcalib.core.records import to_json
from kvcalib.evaluation.options import EvalOptions, TaskOptions
from kvcalib.hf.mxfp4 import dequantize_mxfp4
from kvcalib.serving.options import ServeOptions

if TYPE_CHECKING:
    from kvcalib.calibration.plan import CalibrationPlan
    from kvcalib.evaluation.context import ContextResult
    from kvcalib.evaluation.needle import NeedleResult
    from kvcalib.evaluation.pipeline import EvalResult
    from kvcalib.evaluation.tasks import TaskResult
    from kvcalib.serving.pipeline import ServeCheckResult, ServeEvent
    from kvcalib.validation.report import ValidationReport

__all__ = [
    "calibrate",
    "dequantize_mxfp4",
    "evaluate",
    "evaluate_context",
    "evaluate_needle",
    "evaluate_tasks",
    "plan",
    "plan_serve_check",
    "run_calibration",
    "serve_calibrated",
    "serve_check",
    "validate",
]

logger = logging.getLogger("kvcalib")


def _logged(result: Any) -> Any:
    for note in result.warnings:
        logger.warning("%s", note)
    return result


def _options(cls: type, options: Any, fields: dict[str, Any], name: str) -> Any:
    """`options`, or a `cls` of `fields` (a sequence where the field is a tuple); a keyword that is no field is
    Python's TypeError, options and keywords together a UsageError naming the keywords (they would be dropped)."""
    if options is not None and fields:
        raise UsageError(
            f"{name}() takes options= or keywords, not both: {', '.join(sorted(fields))} given beside options=",
            hint="set them in the options (dataclasses.replace), or pass only keywords",
        )
    if options is not None:
        return options
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in fields:
        if key not in known:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    tuples = {k for k, f in known.items() if typing.get_origin(f.type) is tuple}
    # a string given for a tuple field is one entry (compare="unit"), not its characters
    one = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in fields.items() if k in tuples}
    return cls(**{**fields, **one})


def _keywords(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The function takes `cls`'s fields as keywords, shown in place of `options`' (help(), inspect.signature), and
    gets `options`: the one given, or a `cls` of the keywords (_options)."""

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func)

        @functools.wraps(func)
        def call(*args: Any, options: Any = None, **fields: Any) -> Any:
            own = {k: fields.pop(k) for k in list(fields) if k in sig.parameters}
            return func(*args, options=_options(cls, options, fields, func.__name__), **own)

        fields = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=f.type,
                default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            )
            for f in dataclasses.fields(cls)
            if f.name not in sig.parameters
        ]
        call.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *fields])  # type: ignore[attr-defined]
        return call

    return mark


def plan_serve_check(
    model: str | Path, calibration: CalibrateOptions, device: str, **serve: Any
) -> ServeOptions:
    """`--serve-check DEVICE`: serve-check's options (ServeOptions fields in `serve`), all but the scales checked
    before calibrating."""
    from kvcalib.calibration.recipe import plan_recipe
    from kvcalib.hf.model import resolve_model_dir, resolve_target
    from kvcalib.serving.pipeline import check_serving
    from kvcalib.serving.preflight import check_strategy, validate_target

    options = _options(ServeOptions, None, {**serve, "device": device}, "serve")
    options.check_arguments()
    calibration.check_arguments()
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
    machine: Machine | None = None,
    progress: ProgressCallback | None = None,
) -> CalibrationResult:
    """The calibration itself (kvcalib.calibration.pipeline), its notes logged."""
    from kvcalib.calibration.pipeline import calibrate as run

    return _logged(run(model, dataset, output, options, machine, progress))


def serve_calibrated(
    result: CalibrationResult,
    serving: ServeOptions,
    machine: Machine,
    progress: Callable[[ServeEvent], None] | None = None,
) -> CalibrationResult:
    """serve-check on the checkpoint calibrate just wrote (figures into the model card), its prediction within the
    memory the calibration had (--max-memory's cap too); sets `.serve_check`."""
    from kvcalib.calibration.card import summarize, write_card
    from kvcalib.serving.pipeline import serve_check as run

    served = _logged(run(Path(result.output), serving, progress, machine.memory.available))
    write_card(Path(result.output), summarize(result.validation), serve=to_json(served))
    return dataclasses.replace(result, serve_check=served)


@_keywords(CalibrateOptions)
def plan(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    options: CalibrateOptions | None = None,
    progress: ProgressCallback | None = None,
) -> CalibrationPlan:
    """`kvcalib calibrate ... --plan` (kvcalib.calibration.plan): what `calibrate` with these keywords would do and
    take."""
    from kvcalib.calibration.plan import plan_calibration

    return plan_calibration(model, dataset, output, options, progress=progress)


@_keywords(CalibrateOptions)
def calibrate(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    serve_check: str | None = None,
    serve: dict[str, Any] | None = None,
    options: CalibrateOptions | None = None,
    progress: ProgressCallback | None = None,
    serve_progress: Callable[[ServeEvent], None] | None = None,
) -> CalibrationResult:
    """`kvcalib calibrate`: an FP8-KV checkpoint of `model` at `output`, scales from `dataset`; the CalibrationResult.
    serve_check: a device to serve the result on, as `kvcalib calibrate --serve-check` does (`serve`: ServeOptions
    fields, as for `serve_check`)."""
    machine = Machine.read(options)
    serving = (
        None
        if serve_check is None
        else plan_serve_check(model, options, serve_check, **(serve or {}))
    )
    result = run_calibration(model, dataset, output, options, machine, progress)
    if serving is None or result.validation is None:  # under torchrun, rank 0 serves what it wrote
        return result
    return serve_calibrated(result, serving, machine, serve_progress)


def validate(
    path: str | Path, *, target: str = DEFAULT_TARGET, strict: bool = False
) -> ValidationReport:
    """`kvcalib validate`: the Neuron platform's config rules and kvcalib's checks; the ValidationReport (no torch)."""
    from kvcalib.validation.pipeline import validate_checkpoint

    return validate_checkpoint(Path(path), target, strict=strict)


@_keywords(EvalOptions)
def evaluate(
    checkpoint: str | Path,
    dataset: str,
    *,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """`kvcalib eval`: FP8-KV accuracy on held-out text against the unquantised cache (compare: "unit"
    or other checkpoints); the keywords are EvalOptions' fields, or `options` made already."""
    from kvcalib.evaluation.pipeline import evaluate as run

    return run(str(checkpoint), dataset, options, progress=progress)


@_keywords(EvalOptions)
def evaluate_context(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    nll: bool = True,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> ContextResult:
    """`kvcalib eval-context --lengths L,...`: K/V saturation and ΔNLL (nll) per length and layer; the keywords are
    EvalOptions' fields (num_samples: samples per length), or `options` made already."""
    from kvcalib.evaluation.context import evaluate_context as run

    return run(str(checkpoint), dataset, tuple(lengths), options, progress=progress, nll=nll)


@_keywords(EvalOptions)
def evaluate_needle(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    keys: int | None = None,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> NeedleResult:
    """`kvcalib eval-needle --lengths L,...`: keys found per length and depth, per scale set (`keys` per length
    and depth; None: the needle's default); the keywords are EvalOptions' fields, or `options` made already."""
    from kvcalib.evaluation.needle import evaluate_needle as run

    return run(str(checkpoint), dataset, tuple(lengths), options, keys, progress=progress)


@_keywords(TaskOptions)
def evaluate_tasks(
    checkpoint: str | Path,
    tasks: Sequence[str] | None = None,
    *,
    options: TaskOptions | None = None,
    progress: ProgressCallback | None = None,
) -> TaskResult:
    """`kvcalib eval-tasks`: lm-eval tasks under the chip's FP8-KV numerics, paired item by item; the keywords
    are TaskOptions' fields, or `options` made already (`tasks`, when given, in place of its tasks)."""
    from kvcalib.evaluation.tasks import evaluate_tasks as run

    if isinstance(tasks, str):  # "a,b" as the CLI takes it
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if tasks is not None and tuple(tasks) != options.tasks:
        options = dataclasses.replace(options, tasks=tuple(tasks))
    return run(str(checkpoint), options, progress=progress)


@_keywords(ServeOptions)
def serve_check(
    checkpoint: str | Path,
    *,
    options: ServeOptions | None = None,
    progress: Callable[[ServeEvent], None] | None = None,
) -> ServeCheckResult:
    """`kvcalib serve-check`: serve `checkpoint` on `device` with vLLM's FP8 KV cache, probe it, compare with a
    baseline, always stop the servers; the ServeCheckResult."""
    from kvcalib.serving.pipeline import serve_check as run

    return _logged(run(Path(checkpoint), options, progress))
