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

from kvcalib._version import __version__
from kvcalib.calibration.options import CalibrateOptions
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


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kvcalib {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print kvcalib's version and exit.",
    ),
) -> None:
    """FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU."""


# The commands' own flags; the rest come from the options dataclasses (kvcalib.cli.flags).
AsJson = Annotated[
    bool,
    typer.Option("--json", help="Print the result as JSON on stdout.", rich_help_panel="Output"),
]
Quiet = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print nothing on stderr but errors: no progress, no table.",
        rich_help_panel="Output",
    ),
]
Tasks = Annotated[
    str | None,
    typer.Option(
        "--tasks",
        help="lm-eval tasks, comma-separated (e.g. lambada_openai,arc_easy), each scored on the same items "
        "with and without FP8 KV, paired (lm-eval: the 'tasks' extra).",
        rich_help_panel="Data",
    ),
]
DATA_HELP = "Text file(s) .txt/.jsonl/.json/.parquet/.csv, a directory of them, a save_to_disk directory, or a hub id."


# Its flags: CalibrateOptions' fields, then ServeOptions' for --serve-check (their --device is --serve-check's).
@command(app, "calibrate", CalibrateOptions, ServeOptions)
def calibrate(
    model: Annotated[
        str,
        typer.Argument(help="Local Hugging Face checkpoint directory (or a hub id when online)."),
    ],
    dataset: Annotated[
        str, typer.Option("--dataset", "-d", help=DATA_HELP, rich_help_panel="Data")
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="New checkpoint directory to write.", rich_help_panel="Output"
        ),
    ],
    stream_layers: Annotated[
        bool,
        typer.Option(
            "--stream-layers",
            help="--engine stream: one decoder layer at a time, for models larger than memory.",
            rich_help_panel="Engine",
        ),
    ] = False,
    serve_device: Annotated[
        Literal[DEVICES] | None,
        typer.Option(
            "--serve-check",
            metavar="|".join(DEVICES),
            help="Then serve the new checkpoint with FP8 KV and probe it, as serve-check does (with its "
            "serving flags), on this device; the device and vLLM are checked before calibrating.",
            rich_help_panel="Serving",
        ),
    ] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Print what the run would do and take (engine, memory, disk, an estimated time from a short "
            "timed probe, anything that would stop it), write nothing, exit 0.",
            rich_help_panel="Output",
        ),
    ] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Choose per-layer K/V scales on a dataset and write an FP8-KV checkpoint (then serve-check it)."""
    from kvcalib.api import calibrate_options, plan_serve_check, run_calibration
    from kvcalib.api import plan as run_plan

    with _errors():  # kvcalib.calibrate(...) is these three calls; the CLI renders between them
        fields = split_options(CalibrateOptions, values)
        if stream_layers and fields["engine"] not in (
            "auto",
            "stream",
        ):  # --stream-layers is --engine stream
            raise UsageError(
                f"--stream-layers contradicts --engine {fields['engine']}", hint="pass one of them"
            )
        options = calibrate_options(
            **{**fields, "engine": "stream" if stream_layers else fields["engine"]}
        )
    console = _stderr(quiet)
    if plan:
        with _errors(), progress_bar(console, "probing", "plan") as on_progress:
            result = run_plan(model, dataset, output, options=options, progress=on_progress)
        return _show(render_plan, console, result, as_json)
    if (
        options.ranks is not None and not options.ranks.is_writer
    ):  # other ranks work quietly; rank 0 reports
        with _errors(quiet=True):
            run_calibration(model, dataset, output, options)
        return
    serving = None
    if (
        serve_device is not None
    ):  # everything serving needs but the scales, before an hour of calibration
        with _errors():
            serve = split_options(ServeOptions, values)
            serving = plan_serve_check(model, options, **{**serve, "device": serve_device})
    with _errors(), progress_bar(console) as on_progress, captured_notes() as notes:
        result = run_calibration(model, dataset, output, options, progress=on_progress)
    _report_calibration(console, result, notes, serving, as_json)


def _show(render: Any, console: Console, result: Any, as_json: bool, *args: Any) -> None:
    render(console, result, *args)
    if as_json:
        _print_json(result)


def _report_calibration(
    console: Console, result: Any, notes: list[str], serving: Any, as_json: bool
) -> None:
    """The table; with --serve-check, serve-check's run on the published checkpoint and its exit code."""
    from kvcalib.api import serve_calibrated

    if serving is None:
        return _show(render_calibration, console, result, as_json, notes)
    render_calibration(console, result, notes)
    with (
        _errors(interrupted="every vLLM server serve-check started was stopped"),
        serve_status(console) as on_event,
        captured_notes() as notes,
    ):
        served = serve_calibrated(result, serving, on_event).serve_check
    render_serve_check(console, served, notes)
    if as_json:
        _print_json({"calibration": result, "serve_check": served})
    raise typer.Exit(0 if served.ok else 1)


@app.command()
def validate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory to check.")],
    target: Annotated[
        Literal[tuple(TARGETS)], typer.Option("--target", "-t", help="The chip it is for.")
    ] = DEFAULT_TARGET,
    strict: Annotated[bool, typer.Option("--strict", help="Count warnings as errors.")] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Check a checkpoint against vLLM-on-Neuron's rules and the silent failures it lets through."""
    from kvcalib.api import validate as run_validate

    with _errors():
        report = run_validate(checkpoint, target=target, strict=strict)
    _show(render_report, _stderr(quiet), report, as_json)
    raise typer.Exit(0 if report.ok else 1)


# Its flags: EvalOptions' fields, then TaskOptions' (--tasks) not already among them.
@command(app, "eval", EvalOptions, TaskOptions)
def eval_command(
    ctx: typer.Context,
    checkpoint: Annotated[
        str, typer.Argument(help="Calibrated checkpoint directory (its weights and scales).")
    ],
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            "-d",
            help="Held-out text, in any form calibrate accepts.",
            rich_help_panel="Data",
        ),
    ] = None,
    tasks: Tasks = None,
    context: Annotated[
        str | None,
        typer.Option(
            "--context",
            help="Lengths, comma-separated (e.g. 2048,8192): samples packed from --dataset to each, "
            "--num-samples per length at most; per layer the K/V saturation and absmax past the scales, and ΔNLL on "
            "each sample's last quarter.",
            rich_help_panel="Data",
        ),
    ] = None,
    saturation_only: Annotated[
        bool,
        typer.Option(
            "--saturation-only",
            help="With --context: only the unquantised forward per sample (saturation and "
            "absmax against each scale set), no ΔNLL.",
            rich_help_panel="Data",
        ),
    ] = False,
    needle: Annotated[
        bool,
        typer.Option(
            "--needle",
            help="With --context: the needle probe instead; a 6-digit key placed at 0-100% depth of "
            "held-out text of each length, asked for at the end and greedy-decoded reading the FP8 cache; keys found "
            "per length, depth and scale set, paired against the unquantised cache.",
            rich_help_panel="Data",
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write a PNG of per-layer absmax, SQNR and clipping (with --needle: the heatmap).",
            rich_help_panel="Output",
        ),
    ] = None,
    per_layer: Annotated[
        bool,
        typer.Option(
            "--per-layer",
            help="Print every layer's attention error, ΔNLL alone, SQNR and clipping.",
            rich_help_panel="Output",
        ),
    ] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Predict FP8-KV accuracy with the chip's own numerics, against an unquantised KV cache."""
    from kvcalib.api import eval_options, evaluate
    from kvcalib.evaluation.plot import check_plot_path, plot_eval

    if tasks is not None or dataset is None:
        return _eval_tasks(checkpoint, dataset, tasks, values, as_json, quiet)
    given = ctx.get_parameter_source("num_samples").name != "DEFAULT"  # typer's own click
    keys = values["num_samples"] if given else None  # --needle's default is its own
    with _errors():
        options = eval_options(**split_options(EvalOptions, values))
    console = _stderr(quiet)
    if context is not None or needle or saturation_only:
        return _eval_context(
            checkpoint,
            dataset,
            context,
            options,
            console,
            as_json,
            plot,
            needle,
            keys,
            not saturation_only,
        )
    with _errors(), progress_bar(console, "evaluating", "eval") as on_progress:
        if plot is not None:
            check_plot_path(plot, [checkpoint, dataset, *options.compare])
        result = evaluate(checkpoint, dataset, options=options, progress=on_progress)
        if plot is not None:
            result = dataclasses.replace(result, plot=str(plot_eval(result, plot)))
    _show(render_eval, console, result, as_json, per_layer)


def _eval_context(
    checkpoint: str,
    dataset: str,
    context: str | None,
    options: Any,
    console: Console,
    as_json: bool,
    plot: Path | None,
    needle: bool,
    keys: int | None,
    nll: bool = True,
) -> None:
    """eval --context (kvcalib.evaluation.context); with --needle the needle probe, `keys` per length and depth."""
    from kvcalib.api import evaluate_context, evaluate_needle
    from kvcalib.evaluation.context import parse_lengths
    from kvcalib.evaluation.plot import check_plot_path, plot_needle

    with _errors(), progress_bar(console, "evaluating long context", "eval") as on_progress:
        if context is None or needle and not nll:
            raise UsageError(
                "--needle or --saturation-only runs at the lengths of --context (not both)",
                hint="e.g. --context 1024,4096 --needle",
            )
        lengths = parse_lengths(context)
        if not needle:
            if plot is not None:
                raise UsageError(
                    "--plot with --context draws the needle heatmap: add --needle",
                    hint="or drop --plot",
                )
            result = evaluate_context(
                checkpoint, dataset, lengths, options=options, progress=on_progress, nll=nll
            )
        else:
            if plot is not None:
                check_plot_path(plot, [checkpoint, dataset, *options.compare])
            result = evaluate_needle(
                checkpoint, dataset, lengths, keys=keys, options=options, progress=on_progress
            )
            if plot is not None:
                result = dataclasses.replace(result, plot=str(plot_needle(result, plot)))
    _show(render_needle if needle else render_context, console, result, as_json)


def _eval_tasks(
    checkpoint: str,
    dataset: str | None,
    tasks: str | None,
    values: dict[str, Any],
    as_json: bool,
    quiet: bool,
) -> None:
    """eval --tasks: lm-eval tasks, each run paired against the baseline (kvcalib.evaluation.tasks)."""
    from kvcalib.api import evaluate_tasks, task_options

    console = _stderr(quiet)
    with _errors():
        if dataset is not None or tasks is None:
            raise UsageError(
                "eval needs --dataset (held-out text) or --tasks (lm-eval tasks), not both"
                if dataset is not None
                else "eval needs --dataset DATA or --tasks TASK[,TASK]",
                hint="e.g. kvcalib eval CKPT --dataset held-out.jsonl, or --tasks lambada_openai "
                "--limit 200",
            )
        # --seed shuffles --dataset's rows; lm-eval seeds its own few-shot sampling (TaskOptions.seed)
        options = task_options(
            **split_options(TaskOptions, {k: v for k, v in values.items() if k != "seed"}),
            tasks=[t.strip() for t in tasks.split(",") if t.strip()],
        )
        with progress_bar(console, "evaluating tasks", "eval") as on_progress:
            result = evaluate_tasks(
                checkpoint, options.tasks, options=options, progress=on_progress
            )
    _show(render_tasks, console, result, as_json)


# Its flags: ServeOptions' fields, and TaskOptions' --limit and --task-data for --tasks.
@command(app, "serve-check", ServeOptions, (TaskOptions, ("limit", "task_data")))
def serve_check(
    checkpoint: Annotated[Path, typer.Argument(help="Calibrated checkpoint directory to serve.")],
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help="Prompts: one per line, or .jsonl with 'prompt'.",
            rich_help_panel="Serving",
        ),
    ] = None,
    tasks: Tasks = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
    **values: Any,
) -> None:
    """Serve CKPT with vLLM's FP8 KV cache, probe it, compare with a baseline, and always stop the server."""
    from kvcalib.api import serve_check as run_serve_check
    from kvcalib.serving.prompts import read_prompts_file
    from kvcalib.serving.tasks import TaskSpec

    console = _stderr(quiet)
    with (
        _errors(interrupted="every vLLM server serve-check started was stopped"),
        serve_status(console) as on_event,
        captured_notes() as notes,
    ):
        spec = TaskSpec.from_flags(tasks, values.pop("limit"), values.pop("task_data"))
        result = run_serve_check(
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
    for name, value in {
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "LLM_COMPRESSOR_LOG_DISABLED": "true",
    }.items():
        os.environ.setdefault(name, value)
    app(prog_name="kvcalib")
