"""The `kvcalib` command line: a thin Typer shell over the library.

The only module that imports typer or rich. Each command parses its arguments, calls one
library function and renders the result: `--json` prints the result's `to_dict()` on
stdout, everything for humans goes to stderr. `KvcalibError` is the one error boundary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvcalib.core.errors import KvcalibError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU.",
)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _fail(err: KvcalibError) -> NoReturn:
    console = _stderr()
    console.print(f"[bold red]error:[/] {escape(err.message)}", soft_wrap=True)
    if err.hint:  # escaped: a hint such as `pip install kvcalib[llmcompressor]` is no markup
        console.print(f"[yellow]hint:[/] {escape(err.hint)}", soft_wrap=True)
    raise typer.Exit(err.exit_code)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C would raise KeyboardInterrupt, so every command cleans up alike."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The signals every command treats as Ctrl-C: a CI timeout or `kill` (SIGTERM), a closed terminal (SIGHUP).
_TERMINATING = ("SIGTERM", "SIGHUP")


@contextmanager
def _errors(quiet: bool = False, interrupted: str = "nothing partial was left") -> Iterator[None]:
    """The error boundary: a KvcalibError is one message (exit code by class); SIGINT, SIGTERM and SIGHUP
    unwind the command like Ctrl-C (its cleanup runs) and exit 128 + the signal's number."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {}
    for name in _TERMINATING:
        signum = getattr(signal, name, None)
        if signum is not None:
            try:
                previous[signum] = signal.signal(signum, interrupt)
            except ValueError:  # not the main thread: leave signals alone
                break
    try:
        yield
    except KvcalibError as err:
        if quiet:  # a torchrun rank other than 0: rank 0 reports (with this rank's message)
            raise typer.Exit(err.exit_code) from None
        _fail(err)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        if not quiet:
            _stderr().print(f"[bold red]interrupted[/] ({signal.Signals(signum).name}): {escape(interrupted)}")
        raise typer.Exit(128 + signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _host_cpu(with_capability: bool = True) -> Any:
    """The CPU this runs on: /proc/cpuinfo's flags, or KVCALIB_CPU_FLAGS (space-separated) to describe another."""
    import os

    from kvcalib.core.cpu import HostCpu

    capability = "unknown"
    if with_capability:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    return HostCpu.from_cpuinfo(Path("/proc/cpuinfo"), capability, override=os.environ.get("KVCALIB_CPU_FLAGS"))


BF16_COMPUTE_HELP = ("bf16 models on CPU: auto (float32 matmuls with bf16 rounding where the CPU has no native "
                     "bf16 matmul, i.e. no avx512_bf16/amx_bf16), native, or float32.")

# Options several commands share, declared once.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Bf16Compute = Annotated[str, typer.Option("--bf16-compute", help=BF16_COMPUTE_HELP)]


def _print_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


@app.command()
def calibrate(
    model: str = typer.Argument(..., help="Local Hugging Face checkpoint directory (or a hub id when online)."),
    dataset: str = typer.Option(..., "--dataset", "-d", help="Text file(s) .txt/.jsonl/.json/.parquet/.csv, a directory of them, a save_to_disk directory, or a hub id."),
    output: Path = typer.Option(..., "--output", "-o", help="New checkpoint directory to write."),
    target: str | None = typer.Option(None, "--target", "-t", help="Chip the scales are sized for: trn2 (FP8 max 240), trn3 or gpu (448). Default: the recipe's kvcalib.target, else trn2."),
    split: str = typer.Option("train", "--split", "--dataset-split", help="Dataset split."),
    text_column: str | None = typer.Option(None, "--text-column", help="Column with the text (default: 'text', else chat 'messages')."),
    num_samples: int = typer.Option(512, "--num-samples", "--num-calibration-samples", help="First N rows of the split."),
    max_seq_len: int = typer.Option(2048, "--max-seq-len", "--max-seq-length", help="Tokens per sample at most."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per forward pass."),
    seed: int = typer.Option(42, "--seed", help="Shuffle seed (llm-compressor's default)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), bfloat16, float16 or float32."),
    device: Device = "cpu",
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUTPUT if it exists."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the model's own code."),
    as_json: AsJson = False,
    stream_layers: bool = typer.Option(False, "--stream-layers", help="Load one decoder layer at a time (models larger than memory; chosen automatically when the weights would not fit)."),
    recipe: Path | None = typer.Option(None, "--recipe", help="llm-compressor recipe (YAML) whose kv_cache_scheme to use, e.g. recipes/kv-fp8-trn2.yaml."),
    engine: str = typer.Option("auto", "--engine", help="auto (native, or stream when the weights would not fit), native, stream, or llmcompressor (llm-compressor's oneshot observes; pip install kvcalib\\[llmcompressor])."),
    bf16_compute: Bf16Compute = "auto",
) -> None:
    """Measure per-layer K/V absmax on a dataset and write an FP8-KV checkpoint."""
    import os

    from kvcalib.calibrate import CalibrateOptions, Ranks
    from kvcalib.calibrate import calibrate as run_calibrate
    from kvcalib.calibrate.memory import available_memory

    with _errors():
        ranks = Ranks.from_env(os.environ)  # set by torchrun; None in a plain run
        engine = _engine(engine, stream_layers)
    options = CalibrateOptions(
        target=target, split=split, text_column=text_column, num_samples=num_samples,
        max_seq_len=max_seq_len, batch_size=batch_size, seed=seed, dtype=dtype, device=device,
        overwrite=overwrite, trust_remote_code=trust_remote_code,
        engine=engine, ranks=ranks,
        recipe=str(recipe) if recipe is not None else None,
        bf16_compute=bf16_compute, cpu=_host_cpu(), memory=available_memory(),
        scratch_dir=Path(tempfile.gettempdir()),
    )
    if ranks is not None and not ranks.is_writer:  # other ranks work quietly; rank 0 reports
        with _errors(quiet=True):
            run_calibrate(model, dataset, output, options)
        return
    console = _stderr()
    with _errors(), _progress_bar(console) as on_progress:
        result = run_calibrate(model, dataset, output, options, progress=on_progress)
    _render_calibration(console, result)
    if as_json:
        _print_json(result.to_dict())


def _engine(engine: str, stream_layers: bool) -> str:
    """--stream-layers is --engine stream."""
    if stream_layers and engine not in ("auto", "stream"):
        raise UsageError(f"--stream-layers contradicts --engine {engine}", hint="pass one of them")
    return "stream" if stream_layers else engine


@contextmanager
def _progress_bar(console: Console, label: str = "calibrating") -> Iterator[Callable[[Any], None]]:
    """A progress callback that draws on stderr once the library reports its first stage."""
    columns = (
        TextColumn("{task.description}"), BarColumn(),
        TextColumn("{task.fields[samples]} samples"), TextColumn("{task.fields[tokens]} tok"),
        TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
    )
    bar = Progress(*columns, console=console, transient=True)
    task = bar.add_task("starting", total=None, samples="-", tokens="-", rate="-")
    observe_started: list[float] = []
    labels = {"load-data": "reading dataset", "load-model": "loading model", "write": "writing checkpoint"}

    def on_progress(p: Any) -> None:
        if not bar.live.is_started:
            bar.start()
        if p.stage != "observe":
            bar.update(task, description=labels.get(p.stage, p.stage))
            return
        if not observe_started:
            observe_started.append(time.perf_counter())
        elapsed = time.perf_counter() - observe_started[0]
        rate = f"{p.tokens_done / elapsed:,.0f}" if elapsed > 0 and p.tokens_done else "-"
        where = f" layer {p.layer + 1}/{p.num_layers}" if getattr(p, "num_layers", 0) else ""
        bar.update(task, description=label + where, total=p.tokens_total, completed=p.tokens_done,
                   samples=f"{p.samples_done}/{p.samples_total}",
                   tokens=f"{p.tokens_done:,}/{p.tokens_total:,}", rate=rate)

    try:
        yield on_progress
    finally:
        if bar.live.is_started:
            bar.stop()


def _render_calibration(console: Console, result: Any) -> None:
    table = Table(title=f"KV scales for {result.target}: absmax / {result.fp8_max:g}")
    for column in ("layer", "k absmax", "v absmax", "k_scale", "v_scale"):
        table.add_column(column, justify="right")
    for layer in result.layers:
        table.add_row(str(layer.layer), f"{layer.k_absmax:.4g}", f"{layer.v_absmax:.4g}",
                      f"{layer.k_scale:.4g}", f"{layer.v_scale:.4g}")
    console.print(table)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    if result.validation is not None:
        n_warn = sum(1 for f in result.validation["findings"] if f["severity"] == "warning")
        console.print(f"validation: [green]ok[/] for {result.target}" + (f" ({n_warn} warning(s))" if n_warn else ""))
    console.print(f"compute: {result.compute}", soft_wrap=True, markup=False)
    console.print(
        f"wrote {result.output}: {result.num_samples} samples, {result.num_tokens:,} tokens, "
        f"{result.tokens_per_s:,.0f} tok/s, {result.seconds:.1f} s in all"
    )


@app.command()
def validate(
    checkpoint: Path = typer.Argument(..., help="Checkpoint directory to check."),
    target: str = typer.Option("trn2", "--target", "-t", help="trn2, trn3 or gpu."),
    strict: bool = typer.Option(False, "--strict", help="Count warnings as errors."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Check a checkpoint against vLLM-on-Neuron's rules and the silent failures it lets through."""
    from kvcalib.validate import validate_checkpoint

    with _errors():
        report = validate_checkpoint(checkpoint, target, strict=strict)
    _render_report(_stderr(), report)
    if as_json:
        _print_json(report.to_dict())
    raise typer.Exit(0 if report.ok else 1)


def _render_report(console: Console, report: Any) -> None:
    if report.findings:
        table = Table(title=f"validate {report.checkpoint} for {report.target}")
        for column in ("rule", "severity", "where", "message", "hint"):
            table.add_column(column, overflow="fold")
        colors = {"error": "red", "warning": "yellow", "info": "cyan"}
        for f in report.findings:
            table.add_row(f.rule, f"[{colors.get(f.severity, 'white')}]{f.severity}[/]", f.location or "",
                          f.message, f.hint or "")
        console.print(table)
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(f"{verdict}: {len(report.errors)} error(s), {len(report.warnings)} warning(s)"
                  + (" (strict: warnings count as errors)" if report.strict else ""))


@app.command("eval")
def eval_command(
    checkpoint: str = typer.Argument(..., help="Calibrated checkpoint directory (its weights and scales)."),
    dataset: str = typer.Option(..., "--dataset", "-d", help="Held-out text, in any form calibrate accepts."),
    target: str = typer.Option("trn2", "--target", "-t", help="Chip numerics to emulate: trn2 (240), trn3 or gpu (448)."),
    compare: list[str] = typer.Option([], "--compare", help="Also run 'unit' (all scales 1.0) or another checkpoint's scales; repeatable."),
    split: str = typer.Option("train", "--split", help="Dataset split."),
    text_column: str | None = typer.Option(None, "--text-column", help="Column with the text."),
    num_samples: int = typer.Option(64, "--num-samples", help="First N rows of the split."),
    max_seq_len: int = typer.Option(512, "--max-seq-len", help="Tokens per sample at most."),
    batch_size: int = typer.Option(2, "--batch-size", help="Sequences per forward pass."),
    seed: int = typer.Option(42, "--seed", help="Shuffle seed."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, bfloat16, float16 or float32."),
    device: Device = "cpu",
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of per-layer absmax, SQNR and clipping."),
    as_json: AsJson = False,
    bf16_compute: Bf16Compute = "auto",
) -> None:
    """Predict FP8-KV accuracy with the chip's own numerics, against an unquantised KV cache."""
    from kvcalib.evaluate import EvalOptions, evaluate
    from kvcalib.evaluate.plot import check_plot_path, plot_eval

    options = EvalOptions(target=target, split=split, text_column=text_column, num_samples=num_samples,
                          max_seq_len=max_seq_len, batch_size=batch_size, seed=seed, dtype=dtype, device=device,
                          compare=tuple(compare), bf16_compute=bf16_compute, cpu=_host_cpu())
    console = _stderr()
    with _errors(), _progress_bar(console, "evaluating") as on_progress:
        if plot is not None:
            check_plot_path(plot, [checkpoint, dataset, *compare])
        result = evaluate(checkpoint, dataset, options, progress=on_progress)
        if plot is not None:
            result = dataclasses.replace(result, plot=str(plot_eval(result, plot)))
    _render_eval(console, result)
    if as_json:
        _print_json(result.to_dict())


def _render_eval(console: Console, result: Any) -> None:
    table = Table(title=f"FP8 KV on {result.target} vs an unquantised KV cache, {result.num_tokens:,} tokens")
    for column in ("scales", "NLL", "PPL", "ΔNLL", "KL", "top-1", "K clip", "V clip", "K SQNR"):
        table.add_column(column, justify="right" if column != "scales" else "left", overflow="fold")
    table.add_row("none (bf16)", f"{result.baseline_nll:.4f}", f"{math.exp(result.baseline_nll):.3f}",
                  "", "", "", "", "", "")
    for run in result.runs:
        min_k = min(l.k_sqnr_db for l in run.layers)
        table.add_row(run.name, f"{run.nll:.4f}", f"{run.ppl:.3f}", f"{run.delta_nll:+.4f}", f"{run.kl:.5f}",
                      f"{run.top1:.2%}", f"{run.k_clipped:.3%}", f"{run.v_clipped:.3%}", f"{min_k:.1f} dB")
    console.print(table)
    console.print(f"compute: {result.compute}", soft_wrap=True, markup=False)
    if result.plot:
        console.print(f"plot: {result.plot}")


@app.command("serve-check")
def serve_check(
    checkpoint: Path = typer.Argument(..., help="Calibrated checkpoint directory to serve."),
    device: str = typer.Option(..., "--device", help="trn2 or trn3 (vLLM on Neuron), or cpu (vLLM on CPU)."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel size (default: every NeuronCore; 1 on cpu)."),
    max_model_len: int = typer.Option(2048, "--max-model-len", help="Also --max-num-batched-tokens (Neuron needs them equal)."),
    max_num_seqs: int = typer.Option(4, "--max-num-seqs"),
    port: int | None = typer.Option(None, "--port", help="Port on 127.0.0.1 (default: a free one)."),
    startup_timeout: float = typer.Option(1800.0, "--startup-timeout", help="Seconds to wait for GET /health."),
    stop_timeout: float = typer.Option(60.0, "--stop-timeout", help="Seconds between SIGTERM and SIGKILL."),
    prompts: Path | None = typer.Option(None, "--prompts", help="Prompts: one per line, or .jsonl with 'prompt'."),
    baseline: bool | None = typer.Option(None, "--baseline/--no-baseline", help="Also serve without FP8 KV and compare (default: on for cpu)."),
    vllm_python: Path = typer.Option(Path(sys.executable), "--vllm-python", help="Interpreter of the environment with vLLM."),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="Where the server logs go (default: a new temp dir)."),
    neuron_visible_devices: str | None = typer.Option(None, "--neuron-visible-devices", help="NEURON_VISIBLE_DEVICES for the server, e.g. 0-7."),
    force: bool = typer.Option(False, "--force", help="Serve scales sized for a larger FP8 max than the chip's."),
    as_json: AsJson = False,
) -> None:
    """Serve CKPT with vLLM's FP8 KV cache, probe it, compare with a baseline, and always stop the server."""
    import os

    from kvcalib.serve import ServeOptions
    from kvcalib.serve import serve_check as run_serve_check
    from kvcalib.serve.prompts import read_prompts_file

    console = _stderr()
    with _errors(interrupted="every vLLM server serve-check started was stopped"), \
            _serve_status(console) as on_event:
        options = ServeOptions(
            device=device, tp=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs, port=port,
            startup_timeout_s=startup_timeout, stop_timeout_s=stop_timeout, baseline=baseline,
            prompts=read_prompts_file(prompts) if prompts else None, vllm_python=vllm_python, log_dir=log_dir,
            neuron_visible_devices=neuron_visible_devices, force=force, env=dict(os.environ),
            cpu=_host_cpu(with_capability=False),
        )
        result = run_serve_check(checkpoint, options, progress=on_event)
    _render_serve_check(console, result)
    if as_json:
        _print_json(result.to_dict())
    raise typer.Exit(0 if result.ok else 1)


@contextmanager
def _serve_status(console: Console) -> Iterator[Callable[[Any], None]]:
    """Live status on stderr: the command, then elapsed time and the log's last line while waiting."""
    status = console.status("", spinner="dots") if console.is_terminal else None
    last_print = [0.0]

    def on_event(event: Any) -> None:
        if event.stage == "launch":
            console.print(f"{event.server} server: {event.message}", soft_wrap=True, markup=False, style="bold")
            if status is not None:
                status.start()
        elif event.stage == "wait":
            line = f"{event.server}: waiting for /health, {event.elapsed_s:.0f} s | {event.message[-100:]}"
            if status is not None:
                status.update(line)
            elif event.elapsed_s - last_print[0] >= 15 or event.elapsed_s < last_print[0]:
                last_print[0] = event.elapsed_s
                console.print(line, soft_wrap=True, markup=False)
        elif event.stage == "ready":
            console.print(f"{event.server} server healthy after {event.elapsed_s:.1f} s")
            last_print[0] = 0.0
        elif event.stage == "probe" and status is not None:
            status.update(f"{event.server}: {event.message}")
        elif event.stage == "stopped" and status is not None:
            status.stop()

    try:
        yield on_event
    finally:
        if status is not None:
            status.stop()


def _render_serve_check(console: Console, result: Any) -> None:
    table = Table(title=escape(f"serve-check {result.checkpoint} on {result.device}"))
    for column in ("prompt", "output (FP8 KV)", "baseline", "agreement"):
        table.add_column(column, overflow="fold")
    for p in result.prompts:
        agreement = "-" if p.agreement is None else f"{p.agreement:.2f}"
        table.add_row(escape(p.prompt), escape(repr(p.output)),
                      "-" if p.baseline_output is None else escape(repr(p.baseline_output)),
                      agreement + (f" [red]{escape(p.problem)}[/]" if p.problem else ""))
    console.print(table)
    nll = f"NLL fp8 {result.nll_fp8:.3f}" + ("" if result.nll_baseline is None else f", baseline {result.nll_baseline:.3f}")
    agreement = "" if result.agreement is None else f", mean agreement {result.agreement:.2f}"
    baseline_ready = "" if result.baseline_ready_s is None else f" (baseline {result.baseline_ready_s:.1f} s)"
    console.print(f"ready in {result.ready_s:.1f} s{baseline_ready}; {nll}{agreement}; log {escape(result.log)}")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    for failure in result.failures:
        console.print(f"[red]failed:[/] {escape(failure)}", soft_wrap=True)
    console.print("[bold green]PASSED[/]" if result.ok else "[bold red]FAILED[/]")


def _quiet_libraries() -> None:
    """kvcalib draws its own progress; the libraries' bars and notices would only add noise."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")  # --engine llmcompressor: it logs to stdout
    os.environ.setdefault("TQDM_DISABLE", "1")


def main() -> None:
    _quiet_libraries()
    app(prog_name="kvcalib")
