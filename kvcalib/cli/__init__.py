"""The `kvcalib` command line: a thin Typer shell over the library, the only package that imports typer or rich.
Each command parses, calls one library function and renders: `--json` prints the result's `to_json` on stdout,
everything for humans goes to stderr; `KvcalibError` is the one error boundary (kvcalib.cli.common)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console

from kvcalib import api
from kvcalib._version import __version__
from kvcalib.calibration.options import CalibrateOptions, Machine
from kvcalib.cli.common import _errors, _print_json, _stderr, captured_notes
from kvcalib.cli.flags import command, split_options
from kvcalib.cli.render import (
    progress_bar,
    render_calibration,
    render_context,
    render_eval,
    render_needle,
    render_plan,
    render_report,
    render_tasks,
)
from kvcalib.cli.render_serve import render_serve_check, serve_status
from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import DEFAULT_TARGET, TARGETS
from kvcalib.evaluation.options import EvalOptions, TaskOptions
from kvcalib.serving.options import DEVICES, ServeOptions

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


def _option(kind: Any, *names: str, panel: str | None = None, **more: Any) -> Any:
    """A command's own flag (the rest come from the options dataclasses, kvcalib.cli.flags): `names`, shown in
    --help's `panel`; `more`, typer.Option's (help, metavar, ...)."""
    return Annotated[kind, typer.Option(*names, rich_help_panel=panel, **more)]


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvcalib {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: _option(
        bool,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print kvcalib's version and exit.",
    ) = False,
) -> None:
    """FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU."""


AsJson = _option(bool, "--json", help="Print the result as JSON on stdout.", panel="Output")
Quiet = _option(
    bool,
    "--quiet",
    "-q",
    help="Print nothing on stderr but errors: no progress, no table.",
    panel="Output",
)
Tasks = _option(
    str | None,
    help="lm-eval tasks, comma-separated (e.g. lambada_openai,arc_easy), each scored on the same items "
    "with and without FP8 KV, paired (lm-eval: the 'tasks' extra).",
    panel="Data",
)


# Its flags: CalibrateOptions' fields, then ServeOptions' for --serve-check (their --device is --serve-check's).
@command(app, "calibrate", CalibrateOptions, ServeOptions)
def calibrate(
    model: Annotated[
        str,
        typer.Argument(help="Local Hugging Face checkpoint directory (or a hub id when online)."),
    ],
    dataset: _option(
        str,
        "--dataset",
        "-d",
        help="Text file(s) .txt/.jsonl/.json/.parquet/.csv, a directory of them, a save_to_disk directory, "
        "or a hub id.",
        panel="Data",
    ),
    output: _option(
        Path, "--output", "-o", help="New checkpoint directory to write.", panel="Output"
    ),
    stream_layers: _option(
        bool,
        "--stream-layers",
        help="--engine stream: one decoder layer at a time, for models larger than memory.",
        panel="Engine",
    ) = False,
    serve_device: _option(
        Literal[DEVICES] | None,
        "--serve-check",
        metavar="|".join(DEVICES),
        help="Then serve the new checkpoint with FP8 KV and probe it, as serve-check does (with its "
        "serving flags), on this device; the device and vLLM are checked before calibrating.",
        panel="Serving",
    ) = None,
    plan: _option(
        bool,
        "--plan",
        help="Print what the run would do and take (engine, memory, disk, an estimated time from a short "
        "timed probe, anything that would stop it), write nothing, exit 0.",
        panel="Output",
    ) = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Choose per-layer K/V scales on a dataset and write an FP8-KV checkpoint (then serve-check it)."""
    with _errors():  # kvcalib.calibrate(...) is these calls; the CLI renders between them
        options = CalibrateOptions(**split_options(CalibrateOptions, values))
        if stream_layers:  # --stream-layers is --engine stream
            if options.engine not in ("auto", "stream"):
                raise UsageError(
                    f"--stream-layers contradicts --engine {options.engine}",
                    hint="pass one of them",
                )
            options = dataclasses.replace(options, engine="stream")
        machine = Machine.read(options)
    console = _stderr(quiet)
    if plan:
        with _errors(), progress_bar(console, "plan") as on_progress:
            result = api.plan(model, dataset, output, options=options, progress=on_progress)
        return _show(render_plan, console, result, as_json)
    if machine.ranks is not None and not machine.ranks.is_writer:  # rank 0 reports
        with _errors(quiet=True):
            api.run_calibration(model, dataset, output, options, machine)
        return
    serving = None
    if serve_device is not None:  # all serving needs but the scales, before the calibration
        with _errors():
            serve = {**split_options(ServeOptions, values), "device": serve_device}
            serving = api.plan_serve_check(model, options, **serve)
    with _errors(), progress_bar(console) as on_progress, captured_notes() as notes:
        result = api.run_calibration(model, dataset, output, options, machine, on_progress)
    if serving is None:
        return _show(render_calibration, console, result, as_json, notes)
    render_calibration(console, result, notes)  # then serve-check's run on the published checkpoint
    with (
        _errors(interrupted="every vLLM server serve-check started was stopped"),
        serve_status(console) as on_event,
        captured_notes() as notes,
    ):
        served = api.serve_calibrated(result, serving, machine, on_event).serve_check
    render_serve_check(console, served, notes)
    if as_json:
        _print_json({"calibration": result, "serve_check": served})
    raise typer.Exit(0 if served.ok else 1)


def _show(render: Any, console: Console, result: Any, as_json: bool, *args: Any) -> None:
    render(console, result, *args)
    if as_json:
        _print_json(result)


@app.command()
def validate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory to check.")],
    target: _option(
        Literal[tuple(TARGETS)], "--target", "-t", help="The chip it is for."
    ) = DEFAULT_TARGET,
    strict: _option(bool, "--strict", help="Count warnings as errors.") = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Check a checkpoint against vLLM-on-Neuron's rules and the silent failures it lets through."""
    with _errors():
        report = api.validate(checkpoint, target=target, strict=strict)
    _show(render_report, _stderr(quiet), report, as_json)
    raise typer.Exit(0 if report.ok else 1)


Checkpoint = Annotated[
    str, typer.Argument(help="Calibrated checkpoint directory (its weights and scales).")
]
HeldOut = _option(
    str, "--dataset", "-d", help="Held-out text, in any form calibrate accepts.", panel="Data"
)


def _lengths(text: str) -> tuple[int, ...]:
    """--lengths L1,L2,...: token counts (the library checks each against the model and the memory)."""
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        lengths = ()
    if not lengths:
        raise typer.BadParameter(
            f"{text!r} is not a comma-separated list of token counts (e.g. 2048,8192)"
        )
    return lengths


Lengths = Annotated[
    str,  # parsed by _lengths
    typer.Option(
        help="Prompt lengths in tokens, comma-separated (e.g. 2048,8192).",
        rich_help_panel="Data",
        callback=_lengths,
    ),
]
# eval-context's and eval-needle's EvalOptions fields (one long prompt at a time: no batch, rows or layer runs)
LONG = (
    *("dtype", "device", "trust_remote_code", "bf16_compute", "target", "compare"),
    *("split", "text_column", "fp8_attention"),
)


def _moved(flag: str, to: str, kind: type = bool) -> Any:
    """A flag of `eval` that is a command of its own now: refused (exit 2), naming the command."""

    def refuse(value: Any) -> None:
        if value:
            raise typer.BadParameter(f"now its own command: kvcalib {to} (see its --help)")

    return _option(kind, flag, hidden=True, callback=refuse)


@command(app, "eval", EvalOptions)
def eval_command(
    checkpoint: Checkpoint,
    dataset: HeldOut,
    plot: _option(
        Path | None,
        help="Write a PNG of per-layer absmax, SQNR and clipping.",
        panel="Output",
    ) = None,
    per_layer: _option(
        bool,
        "--per-layer",
        help="Print every layer's attention error, ΔNLL alone, SQNR and clipping.",
        panel="Output",
    ) = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    tasks: _moved("--tasks", "eval-tasks", str | None) = None,
    context: _moved("--context", "eval-context", str | None) = None,
    saturation_only: _moved("--saturation-only", "eval-context") = False,
    needle: _moved("--needle", "eval-needle") = False,
    **values: Any,
) -> None:
    """Predict FP8-KV accuracy on held-out text with the chip's numerics, against an unquantised KV cache."""
    result = _evaluate(api.evaluate, checkpoint, dataset, values, quiet, plot)
    _show(render_eval, *result, as_json, per_layer)


@command(app, "eval-context", (EvalOptions, (*LONG, "num_samples")))
def eval_context(
    checkpoint: Checkpoint,
    dataset: HeldOut,
    lengths: Lengths,
    saturation_only: _option(
        bool,
        "--saturation-only",
        help="Only the unquantised forward per sample (saturation and absmax against each scale set), "
        "no ΔNLL.",
        panel="Data",
    ) = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Long prompts: per length and layer the K/V saturation past the scales, and ΔNLL on the last quarter."""
    result = _evaluate(
        api.evaluate_context,
        checkpoint,
        dataset,
        values,
        quiet,
        lengths=lengths,
        nll=not saturation_only,
    )
    _show(render_context, *result, as_json)


@command(app, "eval-needle", (EvalOptions, (*LONG, "seed", "order")))
def eval_needle(
    checkpoint: Checkpoint,
    dataset: HeldOut,
    lengths: Lengths,
    keys: _option(int | None, help="Keys per length and depth (default 4).", panel="Data") = None,
    plot: _option(
        Path | None, help="Write a PNG heatmap of the keys found.", panel="Output"
    ) = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Passkey retrieval at 0-100% depth of long prompts, decoded from the FP8 cache against the unquantised."""
    result = _evaluate(
        api.evaluate_needle, checkpoint, dataset, values, quiet, plot, lengths=lengths, keys=keys
    )
    _show(render_needle, *result, as_json)


def _evaluate(
    job: Any,
    checkpoint: str,
    dataset: str,
    values: dict[str, Any],
    quiet: bool,
    plot: Path | None = None,
    cls: type = EvalOptions,
    **keywords: Any,
) -> tuple[Console, Any]:
    """eval, eval-context, eval-needle, eval-tasks: the options (`cls`), --plot's path checked before the work, the
    job (a kvcalib.api function), its picture; the console and the result, to render."""
    from kvcalib.evaluation import plot as plots

    console = _stderr(quiet)
    with _errors(), progress_bar(console, "eval") as on_progress:
        options = cls(**values)
        if plot is not None:
            plots.check_plot_path(plot, [checkpoint, dataset, *options.compare])
        result = job(checkpoint, dataset, options=options, progress=on_progress, **keywords)
        if plot is not None:
            draw = plots.plot_eval if job is api.evaluate else plots.plot_needle
            result = dataclasses.replace(result, plot=str(draw(result, plot)))
    return console, result


@command(app, "eval-tasks", TaskOptions)
def eval_tasks(
    checkpoint: Checkpoint,
    tasks: Tasks,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Run lm-eval tasks with the chip's FP8-KV numerics, each item paired against an unquantised KV cache."""
    result = _evaluate(api.evaluate_tasks, checkpoint, tasks, values, quiet, cls=TaskOptions)
    _show(render_tasks, *result, as_json)


# Its flags: ServeOptions' fields, and TaskOptions' --limit and --task-data for --tasks.
@command(app, "serve-check", ServeOptions, (TaskOptions, ("limit", "task_data")))
def serve_check(
    checkpoint: Annotated[Path, typer.Argument(help="Calibrated checkpoint directory to serve.")],
    prompts: _option(
        Path | None,
        help="Prompts: one per line, or .jsonl with 'prompt'.",
        panel="Serving",
    ) = None,
    tasks: Tasks = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Serve CKPT with vLLM's FP8 KV cache, probe it, compare with a baseline, and always stop the server."""
    from kvcalib.serving.prompts import read_prompts_file
    from kvcalib.serving.tasks import TaskSpec

    console = _stderr(quiet)
    with (
        _errors(interrupted="every vLLM server serve-check started was stopped"),
        serve_status(console) as on_event,
        captured_notes() as notes,
    ):
        spec = TaskSpec.from_flags(tasks, values.pop("limit"), values.pop("task_data"))
        result = api.serve_check(
            checkpoint,
            **values,
            prompts=read_prompts_file(prompts) if prompts else None,
            tasks=spec,
            progress=on_event,
        )
    _show(render_serve_check, console, result, as_json, notes)
    raise typer.Exit(0 if result.ok else 1)


def main() -> None:
    # kvcalib draws its own progress; the libraries' bars and notices (llm-compressor's on stdout) are noise
    for setting in (
        "TRANSFORMERS_VERBOSITY=error",
        "HF_HUB_DISABLE_PROGRESS_BARS=1",
        "TQDM_DISABLE=1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS=1",
        "LLM_COMPRESSOR_LOG_DISABLED=true",
    ):
        os.environ.setdefault(*setting.split("="))
    app(prog_name="kvcalib")
