"""`kvcalib.calibrate(...)`: calibrate as the command line runs it (kvcalib/__init__.py lists the API).

What the CLI reads from the machine is read here unless given (the host CPU, so bf16 on a CPU without native
bf16 matmuls takes the float32 path; the memory this process may use; the temporary directory; the torchrun
rank), `--serve-check` is planned and checked before calibrating, and serve-check's figures go into the model
card. The CLI calls these same functions (kvcalib.cli), so a script and the command give the same checkpoint.
Notes (the result's warnings) also go to the `kvcalib` logger, one record each.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.calibrate.options import CalibrateOptions, CalibrationResult
from kvcalib.calibrate.ranks import Ranks
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import UsageError
from kvcalib.core.progress import ProgressCallback

if TYPE_CHECKING:
    from kvcalib.calibrate.plan import CalibrationPlan
    from kvcalib.serve import ServeEvent, ServeOptions

__all__ = ["calibrate", "calibrate_options", "plan", "plan_serve_check", "run_calibration", "serve_calibrated"]

logger = logging.getLogger("kvcalib")


def calibrate_options(*, target: str | None = None, **fields: Any) -> CalibrateOptions:
    """CalibrateOptions as the CLI makes them: any of its fields, with the host CPU, the memory limit, the
    temporary directory and the torchrun rank read from the machine unless given."""
    from kvcalib.hf.memory import available_memory

    fields.setdefault("cpu", HostCpu.detect())
    fields.setdefault("memory", available_memory())
    fields.setdefault("scratch_dir", Path(tempfile.gettempdir()))
    fields.setdefault("ranks", Ranks.from_env(os.environ))
    return CalibrateOptions(target=target, **fields)


def plan_serve_check(model: str | Path, calibration: CalibrateOptions, device: str, **serve: Any) -> ServeOptions:
    """`--serve-check DEVICE`: serve-check's options (ServeOptions fields in `serve`), and everything serving
    needs but the scales checked before calibrating: the recipe's strategy on the device, the target's FP8 max
    against the device's, vLLM and the device themselves."""
    from kvcalib.calibrate.recipe import plan_recipe
    from kvcalib.hf.model import resolve_model_dir, resolve_target
    from kvcalib.serve.api import serve_options
    from kvcalib.serve.pipeline import check_serving
    from kvcalib.serve.preflight import check_strategy, validate_target

    serve.setdefault("memory_bytes", calibration.memory.available if calibration.memory else None)
    options = serve_options(device, **serve)
    options.check_arguments()
    plan = plan_recipe(calibration.recipe, calibration.target, calibration.engine, calibration.strategy)
    sized_for, served_on = resolve_target(plan.target), resolve_target(validate_target(device))
    check_strategy(plan.strategy, device)
    if sized_for.fp8_max > served_on.fp8_max:
        raise UsageError(f"--target {sized_for.name} sizes the scales for FP8 max {sized_for.fp8_max:g}, but "
                         f"{device} clamps at {served_on.fp8_max:g}: serve-check would refuse the result",
                         hint=f"calibrate with --target {served_on.name} for --serve-check {device}")
    check_serving(resolve_model_dir(model), options)
    return options


def run_calibration(model: str | Path, dataset: str, output: str | Path, options: CalibrateOptions,
                    progress: ProgressCallback | None = None) -> CalibrationResult:
    """The calibration itself (kvcalib.calibrate.pipeline), its notes logged."""
    from kvcalib.calibrate.pipeline import calibrate as run

    result = run(model, dataset, output, options, progress=progress)
    for note in result.warnings:
        logger.warning("%s", note)
    return result


def serve_calibrated(result: CalibrationResult, serving: ServeOptions,
                     progress: Callable[[ServeEvent], None] | None = None) -> CalibrationResult:
    """serve-check on the checkpoint calibrate just wrote; its figures join validate's in the model card.
    The result comes back with `.serve_check` set."""
    from kvcalib.calibrate.card import summarize, write_card
    from kvcalib.serve.api import serve_check

    served = serve_check(result.output, options=serving, progress=progress)
    write_card(Path(result.output), summarize(result.validation), serve=served.to_dict())
    return dataclasses.replace(result, serve_check=served)


def plan(model: str | Path, dataset: str, output: str | Path, *, options: CalibrateOptions | None = None,
         progress: ProgressCallback | None = None, **fields: Any) -> CalibrationPlan:
    """`kvcalib calibrate ... --plan`: the engine, memory, disk and an estimated wall time from a short timed probe,
    and what would stop the run, with nothing written (kvcalib.calibrate.plan). `fields`: as for `calibrate`."""
    from kvcalib.calibrate.plan import plan_calibration

    return plan_calibration(model, dataset, output, options or calibrate_options(**fields), progress=progress)


def calibrate(model: str | Path, dataset: str, output: str | Path, *, target: str | None = None,
              num_samples: int = 512, max_seq_len: int = 2048, recipe: str | None = None,
              scale_objective: str = "attention", serve_check: str | None = None,
              serve: dict[str, Any] | None = None, progress: ProgressCallback | None = None,
              serve_progress: Callable[[ServeEvent], None] | None = None, **options: Any) -> CalibrationResult:
    """Measure per-layer K/V absmax of `model` on `dataset` and write an FP8-KV checkpoint to `output`
    (`kvcalib calibrate`). Returns the CalibrationResult (`.to_dict()` is the command's --json).

    target: trn2 (FP8 max 240), trn3 or gpu (448); None: the recipe's, else trn2. recipe: a shipped recipe by
    name (trn2, trn3, gpu) or an llm-compressor recipe file. Any other CalibrateOptions field passes through
    (batch_size, engine, headroom, dtype, overwrite, bf16_compute, ...). serve_check: then serve the new
    checkpoint on that device (`--serve-check`: trn2, trn3, cpu, cuda) with `serve` holding ServeOptions fields
    (vllm_python, tp, max_model_len, ...); the device is checked before calibrating, and the result's
    `.serve_check` holds serve-check's result (`.ok` its verdict).
    """
    calibration = calibrate_options(target=target, num_samples=num_samples, max_seq_len=max_seq_len, recipe=recipe,
                                    scale_objective=scale_objective, **options)
    serving = None if serve_check is None else plan_serve_check(model, calibration, serve_check, **(serve or {}))
    result = run_calibration(model, dataset, output, calibration, progress)
    return result if serving is None else serve_calibrated(result, serving, serve_progress)
