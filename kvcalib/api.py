"""The public API: the jobs as the command line runs them (kvcalib.cli calls these same functions; see kvcalib).

What the CLI reads from the machine is read here unless given: the host CPU, the memory this process may use, the
temporary directory, the torchrun rank and the environment servers inherit (None: this machine's). Each public
function takes every field of its options class as a keyword whose default is the field's (`CalibrateOptions.seed`),
so the default is declared once, in the options class, and the CLI reads the same field; importing this module loads
no torch."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.calibration.options import (
    CalibrateOptions,
    CalibrationResult,
    Engine,
    ScaleObjective,
    Strategy,
)
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.core.options import Bf16Compute, Device, Dtype
from kvcalib.core.progress import ProgressCallback
from kvcalib.core.records import to_json
from kvcalib.evaluation.options import EvalOptions, TaskOptions
from kvcalib.hf.mxfp4 import dequantize_mxfp4
from kvcalib.serving.options import ServeOptions

if TYPE_CHECKING:
    from kvcalib.calibration.plan import CalibrationPlan
    from kvcalib.calibration.ranks import Ranks
    from kvcalib.evaluation.context import ContextResult
    from kvcalib.evaluation.needle import NeedleResult
    from kvcalib.evaluation.pipeline import EvalResult
    from kvcalib.evaluation.tasks import TaskResult
    from kvcalib.hf.memory import MemoryLimit
    from kvcalib.serving.pipeline import ServeCheckResult, ServeEvent
    from kvcalib.serving.prompts import Prompt
    from kvcalib.serving.tasks import TaskSpec
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


def _fields(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The entries of `given` (a function's locals()) that are fields of `cls`; None for a field whose default is
    built (default_factory) leaves it out, so the field builds it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return {
        k: v
        for k, v in given.items()
        if k in fields and not (v is None and fields[k].default_factory is not dataclasses.MISSING)
    }


def calibrate_options(**fields: Any) -> CalibrateOptions:
    """CalibrateOptions as the CLI makes them: the host CPU, memory, scratch directory and torchrun rank read
    unless given (not None)."""
    from kvcalib.calibration.ranks import Ranks
    from kvcalib.hf.memory import available_memory

    machine = {
        "cpu": HostCpu.detect,
        "memory": available_memory,
        "scratch_dir": lambda: Path(tempfile.gettempdir()),
        "ranks": lambda: Ranks.from_env(os.environ),
    }
    read = {k: get() for k, get in machine.items() if fields.get(k) is None}
    return CalibrateOptions(**{**fields, **read})


def plan_serve_check(
    model: str | Path, calibration: CalibrateOptions, device: str, **serve: Any
) -> ServeOptions:
    """`--serve-check DEVICE`: serve-check's options (ServeOptions fields in `serve`), all but the scales checked
    before calibrating."""
    from kvcalib.calibration.recipe import plan_recipe
    from kvcalib.hf.model import resolve_model_dir, resolve_target
    from kvcalib.serving.pipeline import check_serving
    from kvcalib.serving.preflight import check_strategy, validate_target

    if serve.get("memory_bytes") is None and calibration.memory is not None:
        serve["memory_bytes"] = calibration.memory.available
    options = serve_options(device=device, **serve)
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

    served = serve_check(result.output, device=serving.device, options=serving, progress=progress)
    write_card(Path(result.output), summarize(result.validation), serve=to_json(served))
    return dataclasses.replace(result, serve_check=served)


def plan(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    dtype: Dtype = CalibrateOptions.dtype,
    device: Device = CalibrateOptions.device,
    trust_remote_code: bool = CalibrateOptions.trust_remote_code,
    bf16_compute: Bf16Compute = CalibrateOptions.bf16_compute,
    split: str = CalibrateOptions.split,
    text_column: str | None = CalibrateOptions.text_column,
    seed: int = CalibrateOptions.seed,
    add_special_tokens: bool | None = CalibrateOptions.add_special_tokens,
    cpu: HostCpu | None = CalibrateOptions.cpu,
    target: str | None = CalibrateOptions.target,
    num_samples: int = CalibrateOptions.num_samples,
    max_seq_len: int = CalibrateOptions.max_seq_len,
    batch_size: int = CalibrateOptions.batch_size,
    max_memory: float | None = CalibrateOptions.max_memory,
    overwrite: bool = CalibrateOptions.overwrite,
    engine: Engine = CalibrateOptions.engine,
    recipe: str | None = CalibrateOptions.recipe,
    strategy: Strategy | None = CalibrateOptions.strategy,
    attention_scales: bool = CalibrateOptions.attention_scales,
    scale_objective: ScaleObjective = CalibrateOptions.scale_objective,
    headroom: float = CalibrateOptions.headroom,
    extra_provenance: dict[str, Any] | None = None,
    ranks: Ranks | None = CalibrateOptions.ranks,
    memory: MemoryLimit | None = CalibrateOptions.memory,
    scratch_dir: Path | None = CalibrateOptions.scratch_dir,
    options: CalibrateOptions | None = None,
    progress: ProgressCallback | None = None,
) -> CalibrationPlan:
    """`kvcalib calibrate ... --plan` (kvcalib.calibration.plan): what `calibrate` with these keywords would do and
    take, or with `options` made already."""
    from kvcalib.calibration.plan import plan_calibration

    options = options or calibrate_options(**_fields(CalibrateOptions, locals()))
    return plan_calibration(model, dataset, output, options, progress=progress)


def calibrate(
    model: str | Path,
    dataset: str,
    output: str | Path,
    *,
    dtype: Dtype = CalibrateOptions.dtype,
    device: Device = CalibrateOptions.device,
    trust_remote_code: bool = CalibrateOptions.trust_remote_code,
    bf16_compute: Bf16Compute = CalibrateOptions.bf16_compute,
    split: str = CalibrateOptions.split,
    text_column: str | None = CalibrateOptions.text_column,
    seed: int = CalibrateOptions.seed,
    add_special_tokens: bool | None = CalibrateOptions.add_special_tokens,
    cpu: HostCpu | None = CalibrateOptions.cpu,
    target: str | None = CalibrateOptions.target,
    num_samples: int = CalibrateOptions.num_samples,
    max_seq_len: int = CalibrateOptions.max_seq_len,
    batch_size: int = CalibrateOptions.batch_size,
    max_memory: float | None = CalibrateOptions.max_memory,
    overwrite: bool = CalibrateOptions.overwrite,
    engine: Engine = CalibrateOptions.engine,
    recipe: str | None = CalibrateOptions.recipe,
    strategy: Strategy | None = CalibrateOptions.strategy,
    attention_scales: bool = CalibrateOptions.attention_scales,
    scale_objective: ScaleObjective = CalibrateOptions.scale_objective,
    headroom: float = CalibrateOptions.headroom,
    extra_provenance: dict[str, Any] | None = None,
    ranks: Ranks | None = CalibrateOptions.ranks,
    memory: MemoryLimit | None = CalibrateOptions.memory,
    scratch_dir: Path | None = CalibrateOptions.scratch_dir,
    serve_check: str | None = None,
    serve: dict[str, Any] | None = None,
    progress: ProgressCallback | None = None,
    serve_progress: Callable[[ServeEvent], None] | None = None,
) -> CalibrationResult:
    """`kvcalib calibrate`: an FP8-KV checkpoint of `model` at `output`, scales from `dataset`; the CalibrationResult.
    The keywords are CalibrateOptions' fields; serve_check: a device to serve the result on, as `kvcalib calibrate
    --serve-check` does (`serve`: ServeOptions fields, as for `serve_check`)."""
    calibration = calibrate_options(**_fields(CalibrateOptions, locals()))
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


def eval_options(**fields: Any) -> EvalOptions:
    """EvalOptions as the CLI makes them, the host CPU read unless given (not None)."""
    if fields.get("cpu") is None:
        fields["cpu"] = HostCpu.detect()
    return EvalOptions(**{**fields, "compare": tuple(fields.get("compare", ()))})


def task_options(**fields: Any) -> TaskOptions:
    """TaskOptions as the CLI makes them (lm-eval tasks by name; limit, num_fewshot, task_data, ...)."""
    tuples = ("tasks", "compare", "include_path")
    return TaskOptions(**{k: tuple(v) if k in tuples else v for k, v in fields.items()})


def evaluate(
    checkpoint: str | Path,
    dataset: str,
    *,
    dtype: Dtype = EvalOptions.dtype,
    device: Device = EvalOptions.device,
    trust_remote_code: bool = EvalOptions.trust_remote_code,
    bf16_compute: Bf16Compute = EvalOptions.bf16_compute,
    target: str = EvalOptions.target,
    batch_size: int = EvalOptions.batch_size,
    compare: Sequence[str] = EvalOptions.compare,
    split: str = EvalOptions.split,
    text_column: str | None = EvalOptions.text_column,
    seed: int = EvalOptions.seed,
    add_special_tokens: bool | None = EvalOptions.add_special_tokens,
    cpu: HostCpu | None = EvalOptions.cpu,
    num_samples: int = EvalOptions.num_samples,
    max_seq_len: int = EvalOptions.max_seq_len,
    order: str | None = EvalOptions.order,
    fp8_attention: bool = EvalOptions.fp8_attention,
    layer_rows: int = EvalOptions.layer_rows,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """`kvcalib eval --dataset`: FP8-KV accuracy on held-out text against the unquantised cache (compare: "unit"
    or other checkpoints); the keywords are EvalOptions' fields, or `options` made already."""
    from kvcalib.evaluation.pipeline import evaluate as run

    options = options or eval_options(**_fields(EvalOptions, locals()))
    return run(str(checkpoint), dataset, options, progress=progress)


def evaluate_context(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    nll: bool = True,
    dtype: Dtype = EvalOptions.dtype,
    device: Device = EvalOptions.device,
    trust_remote_code: bool = EvalOptions.trust_remote_code,
    bf16_compute: Bf16Compute = EvalOptions.bf16_compute,
    target: str = EvalOptions.target,
    batch_size: int = EvalOptions.batch_size,
    compare: Sequence[str] = EvalOptions.compare,
    split: str = EvalOptions.split,
    text_column: str | None = EvalOptions.text_column,
    seed: int = EvalOptions.seed,
    add_special_tokens: bool | None = EvalOptions.add_special_tokens,
    cpu: HostCpu | None = EvalOptions.cpu,
    num_samples: int = EvalOptions.num_samples,
    max_seq_len: int = EvalOptions.max_seq_len,
    order: str | None = EvalOptions.order,
    fp8_attention: bool = EvalOptions.fp8_attention,
    layer_rows: int = EvalOptions.layer_rows,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> ContextResult:
    """`kvcalib eval --context L,...`: K/V saturation and ΔNLL (nll) per length and layer; the keywords are
    EvalOptions' fields (num_samples: samples per length), or `options` made already."""
    from kvcalib.evaluation.context import evaluate_context as run

    options = options or eval_options(**_fields(EvalOptions, locals()))
    return run(str(checkpoint), dataset, tuple(lengths), options, progress=progress, nll=nll)


def evaluate_needle(
    checkpoint: str | Path,
    dataset: str,
    lengths: Sequence[int],
    *,
    keys: int | None = None,
    dtype: Dtype = EvalOptions.dtype,
    device: Device = EvalOptions.device,
    trust_remote_code: bool = EvalOptions.trust_remote_code,
    bf16_compute: Bf16Compute = EvalOptions.bf16_compute,
    target: str = EvalOptions.target,
    batch_size: int = EvalOptions.batch_size,
    compare: Sequence[str] = EvalOptions.compare,
    split: str = EvalOptions.split,
    text_column: str | None = EvalOptions.text_column,
    seed: int = EvalOptions.seed,
    add_special_tokens: bool | None = EvalOptions.add_special_tokens,
    cpu: HostCpu | None = EvalOptions.cpu,
    num_samples: int = EvalOptions.num_samples,
    max_seq_len: int = EvalOptions.max_seq_len,
    order: str | None = EvalOptions.order,
    fp8_attention: bool = EvalOptions.fp8_attention,
    layer_rows: int = EvalOptions.layer_rows,
    options: EvalOptions | None = None,
    progress: ProgressCallback | None = None,
) -> NeedleResult:
    """`kvcalib eval --context L,... --needle`: keys found per length and depth, per scale set (`keys` per length
    and depth; None: the needle's default); the keywords are EvalOptions' fields, or `options` made already."""
    from kvcalib.evaluation.needle import evaluate_needle as run

    options = options or eval_options(**_fields(EvalOptions, locals()))
    return run(str(checkpoint), dataset, tuple(lengths), options, keys, progress=progress)


def evaluate_tasks(
    checkpoint: str | Path,
    tasks: Sequence[str],
    *,
    dtype: Dtype = TaskOptions.dtype,
    device: Device = TaskOptions.device,
    trust_remote_code: bool = TaskOptions.trust_remote_code,
    bf16_compute: Bf16Compute = TaskOptions.bf16_compute,
    target: str = TaskOptions.target,
    batch_size: int = TaskOptions.batch_size,
    compare: Sequence[str] = TaskOptions.compare,
    limit: int | None = TaskOptions.limit,
    num_fewshot: int | None = TaskOptions.num_fewshot,
    include_path: Sequence[str] = TaskOptions.include_path,
    task_data: str | None = TaskOptions.task_data,
    seed: int = TaskOptions.seed,
    extra_runs: tuple[tuple[str, str, str], ...] = TaskOptions.extra_runs,
    options: TaskOptions | None = None,
    progress: ProgressCallback | None = None,
) -> TaskResult:
    """`kvcalib eval --tasks`: lm-eval tasks under the chip's FP8-KV numerics, paired item by item; the keywords
    are TaskOptions' fields, or `options` made already."""
    from kvcalib.evaluation.tasks import evaluate_tasks as run

    options = options or task_options(**_fields(TaskOptions, locals()))
    return run(str(checkpoint), options, progress=progress)


def serve_options(**fields: Any) -> ServeOptions:
    """ServeOptions as the CLI makes them: the environment, CPU flags and memory read unless given (not None)."""
    from kvcalib.hf.memory import available_memory

    machine = {
        "env": lambda: dict(os.environ),
        "cpu": lambda: HostCpu.detect(with_capability=False),
        "memory_bytes": lambda: available_memory().available,
    }
    read = {k: get() for k, get in machine.items() if fields.get(k) is None}
    return ServeOptions(**{**fields, **read})


def serve_check(
    checkpoint: str | Path,
    *,
    device: str,
    tp: int | None = ServeOptions.tp,
    max_model_len: int = ServeOptions.max_model_len,
    max_num_seqs: int = ServeOptions.max_num_seqs,
    port: int | None = ServeOptions.port,
    startup_timeout_s: float = ServeOptions.startup_timeout_s,
    stop_timeout_s: float = ServeOptions.stop_timeout_s,
    prompts: tuple[Prompt, ...] | None = ServeOptions.prompts,
    baseline: bool | None = ServeOptions.baseline,
    max_tokens: int = ServeOptions.max_tokens,
    vllm_python: Path | None = None,
    log_dir: Path | None = ServeOptions.log_dir,
    neuron_visible_devices: str | None = ServeOptions.neuron_visible_devices,
    force: bool = ServeOptions.force,
    env: Mapping[str, str] | None = None,
    sysfs_root: Path = ServeOptions.sysfs_root,
    dev_root: Path = ServeOptions.dev_root,
    cpu: HostCpu | None = ServeOptions.cpu,
    canary: bool | None = ServeOptions.canary,
    predict: bool = ServeOptions.predict,
    memory_bytes: int | None = ServeOptions.memory_bytes,
    tasks: TaskSpec | None = ServeOptions.tasks,
    context: int | None = ServeOptions.context,
    options: ServeOptions | None = None,
    progress: Callable[[ServeEvent], None] | None = None,
) -> ServeCheckResult:
    """`kvcalib serve-check`: serve `checkpoint` on `device` with vLLM's FP8 KV cache, probe it, compare with a
    baseline, always stop the servers; the ServeCheckResult. The keywords are ServeOptions' fields (vllm_python None:
    this Python; env None: this process's environment), or `options` made already."""
    from kvcalib.serving.pipeline import serve_check as run

    options = options or serve_options(**_fields(ServeOptions, locals()))
    return _logged(run(Path(checkpoint), options, progress=progress))
