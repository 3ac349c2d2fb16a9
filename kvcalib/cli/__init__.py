"""The `kvcalib` command line: a thin Typer shell over the library.

The only package that imports typer or rich (kvcalib.cli.common holds what every command shares). Each command parses its arguments, calls one
library function and renders the result: `--json` prints the result's `to_dict()` on
stdout, everything for humans goes to stderr. `KvcalibError` is the one error boundary.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvcalib.cli.common import _errors, _print_json, _stderr, captured_notes
from kvcalib.cli.render import (progress_bar, render_calibration, render_context, render_eval, render_needle,
                                render_plan, render_report, render_serve_check, render_tasks, serve_status)
from kvcalib.core.errors import UsageError
from kvcalib.core.fp8 import DEFAULT_TARGET

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU.",
)


def _print_version(value: bool) -> None:
    if value:
        from kvcalib._version import __version__

        sys.stdout.write(f"kvcalib {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print kvcalib's version and exit."),
) -> None:
    """FP8 KV-cache calibration for vLLM on AWS Neuron (Trainium 2/3) and GPU."""


BF16_COMPUTE_HELP = ("bf16 models on CPU: auto (float32 matmuls with bf16 rounding where the CPU has no native "
                     "bf16 matmul, i.e. no avx512_bf16/amx_bf16), native, or float32.")

CANARY_HELP = ("Also serve a copy with every K/V scale divided by 64, which must answer worse: proof that the server "
               "applies the scales (default: on for cpu and cuda, off on Neuron, where each copy is another compile).")
PREDICT_HELP = "kvcalib's emulated ΔNLL of the probe text (in-process on CPU) next to the served one."

# Options several commands share, declared once.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Device = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
Bf16Compute = Annotated[str, typer.Option("--bf16-compute", help=BF16_COMPUTE_HELP)]
SpecialTokens = Annotated[bool | None, typer.Option(
    "--add-special-tokens/--no-add-special-tokens", show_default=False,
    help="Add the tokenizer's special tokens (e.g. BOS) to every row / to none. Default: as vLLM serves it, "
         "plain text with them, chat-template text without.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on stderr but errors: no progress, no table.")]
# serve-check's, which calibrate --serve-check takes too
Tp = Annotated[int | None, typer.Option("--tp", help="Tensor-parallel size (default: every NeuronCore; 1 on cpu).")]
MaxModelLen = Annotated[int, typer.Option("--max-model-len", help="Also --max-num-batched-tokens (Neuron needs them equal).")]
StartupTimeout = Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for GET /health.")]
# the default is this interpreter: shown as words, since a path depends on the machine (rich cuts a long one)
VllmPython = Annotated[Path, typer.Option("--vllm-python", help="Interpreter of the environment with vLLM.",
                                          show_default="this Python")]
LogDir = Annotated[Path | None, typer.Option("--log-dir", help="Where the server logs go (default: a new temp dir).")]


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
    recipe: str | None = typer.Option(None, "--recipe", metavar="NAME|FILE", help="llm-compressor recipe whose kv_cache_scheme to use: a shipped one by name (trn2, trn3, gpu) or a YAML file."),
    engine: str = typer.Option("auto", "--engine", help="auto (native, or stream when the weights would not fit), native, stream, or llmcompressor (llm-compressor's oneshot observes; pip install kvcalib\\[llmcompressor])."),
    strategy: str | None = typer.Option(None, "--strategy", help="tensor (one K and one V scale per layer) or attn_head (one per KV head; --target gpu only: vLLM on Neuron cannot load them). Default: the recipe's kv_cache_scheme, else tensor."),
    attention_scales: bool = typer.Option(False, "--attention-scales", help="Also observe Q after RoPE (and q-norm) and write self_attn.q_scale with llm-compressor's FP8-attention config group (GPU vLLM's FP8 attention reads it; the Neuron plugin does not yet)."),
    bf16_compute: Bf16Compute = "auto",
    add_special_tokens: SpecialTokens = None,
    scale_objective: str = typer.Option("attention", "--scale-objective", help="attention (default: per layer, the scale whose attention output is closest to the unquantised one, clipping where that helps) or absmax (absmax / FP8 max, never clipping: llm-compressor's rule)."),
    headroom: float = typer.Option(1.0, "--headroom", help="K/V scales that clip nothing sized for this many times the absmax seen (1: none): room for contexts far longer than the samples, where absmax grows (e.g. 1.4142)."),
    serve_device: str | None = typer.Option(None, "--serve-check", help="Then serve the new checkpoint with FP8 KV and probe it, as `kvcalib serve-check OUT --device DEVICE` does (trn2, trn3, cpu, cuda); the device and vLLM are checked before calibrating."),
    vllm_python: VllmPython = Path(sys.executable),
    tp: Tp = None,
    max_model_len: MaxModelLen = 2048,
    startup_timeout: StartupTimeout = 1800.0,
    log_dir: LogDir = None,
    plan: bool = typer.Option(False, "--plan", help="Print what the run would do and take (engine, memory, disk, an estimated time from a short timed probe, anything that would stop it), write nothing, exit 0."),
    quiet: Quiet = False,
) -> None:
    """Measure per-layer K/V absmax on a dataset and write an FP8-KV checkpoint (then serve-check it)."""
    from kvcalib.calibrate.api import calibrate_options, plan_serve_check, run_calibration

    with _errors():  # kvcalib.calibrate(...) is these three calls; the CLI renders between them
        options = calibrate_options(
            target=target, split=split, text_column=text_column, num_samples=num_samples,
            max_seq_len=max_seq_len, batch_size=batch_size, seed=seed, dtype=dtype, device=device,
            overwrite=overwrite, trust_remote_code=trust_remote_code, engine=_engine(engine, stream_layers),
            recipe=recipe, strategy=strategy, attention_scales=attention_scales, bf16_compute=bf16_compute,
            scale_objective=scale_objective, headroom=headroom, add_special_tokens=add_special_tokens)
    if plan:
        return _plan(model, dataset, output, options, as_json, quiet)
    if options.ranks is not None and not options.ranks.is_writer:  # other ranks work quietly; rank 0 reports
        return _quiet_rank(run_calibration, model, dataset, output, options)
    serving = None
    if serve_device is not None:  # everything serving needs but the scales, before an hour of calibration
        with _errors():
            serving = plan_serve_check(model, options, serve_device, vllm_python=vllm_python, tp=tp,
                                       max_model_len=max_model_len, startup_timeout_s=startup_timeout,
                                       log_dir=log_dir)
    console = _stderr(quiet)
    with _errors(), progress_bar(console) as on_progress, captured_notes() as notes:
        result = run_calibration(model, dataset, output, options, progress=on_progress)
    _report_calibration(console, result, notes, serving, as_json)


def _plan(model: str, dataset: str, output: Path, options: Any, as_json: bool, quiet: bool) -> None:
    """calibrate --plan: the plan, rendered (and --json); nothing written, exit 0."""
    from kvcalib.calibrate.api import plan

    console = _stderr(quiet)
    with _errors(), progress_bar(console, "probing", "plan") as on_progress:
        result = plan(model, dataset, output, options=options, progress=on_progress)
    render_plan(console, result)
    if as_json:
        _print_json(result.to_dict())


def _quiet_rank(run: Any, *args: Any) -> None:
    with _errors(quiet=True):
        run(*args)


def _report_calibration(console: Console, result: Any, notes: list[str], serving: Any, as_json: bool) -> None:
    """The table; then, with --serve-check, serve-check's run on the published checkpoint (its figures go into
    the model card) and its exit code."""
    from kvcalib.calibrate.api import serve_calibrated

    render_calibration(console, result, notes)
    if serving is None:
        if as_json:
            _print_json(result.to_dict())
        return
    with _errors(interrupted="every vLLM server serve-check started was stopped"), \
            serve_status(console) as on_event, captured_notes() as notes:
        served = serve_calibrated(result, serving, on_event).serve_check
    render_serve_check(console, served, notes)
    if as_json:
        _print_json({"calibration": result.to_dict(), "serve_check": served.to_dict()})
    raise typer.Exit(0 if served.ok else 1)


def _engine(engine: str, stream_layers: bool) -> str:
    """--stream-layers is --engine stream."""
    if stream_layers and engine not in ("auto", "stream"):
        raise UsageError(f"--stream-layers contradicts --engine {engine}", hint="pass one of them")
    return "stream" if stream_layers else engine


@app.command()
def validate(
    checkpoint: Path = typer.Argument(..., help="Checkpoint directory to check."),
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help="trn2, trn3 or gpu."),
    strict: bool = typer.Option(False, "--strict", help="Count warnings as errors."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    quiet: Quiet = False,
) -> None:
    """Check a checkpoint against vLLM-on-Neuron's rules and the silent failures it lets through."""
    from kvcalib.validate.api import validate as run_validate

    with _errors():
        report = run_validate(checkpoint, target=target, strict=strict)
    render_report(_stderr(quiet), report)
    if as_json:
        _print_json(report.to_dict())
    raise typer.Exit(0 if report.ok else 1)


@app.command("eval")
def eval_command(
    checkpoint: str = typer.Argument(..., help="Calibrated checkpoint directory (its weights and scales)."),
    dataset: str | None = typer.Option(None, "--dataset", "-d", help="Held-out text, in any form calibrate accepts."),
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t",
                               help="Chip numerics to emulate: trn2 (240), trn3 or gpu (448)."),
    compare: list[str] = typer.Option([], "--compare", help="Also run 'unit' (all scales 1.0) or another checkpoint's scales; repeatable."),
    tasks: str | None = typer.Option(None, "--tasks", help="lm-eval tasks instead of --dataset, comma-separated (e.g. lambada_openai,arc_easy): each run scored on the same items, paired against the baseline (lm-eval: the 'tasks' extra)."),
    limit: int | None = typer.Option(None, "--limit", help="With --tasks: items per task (lm-eval's --limit)."),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="With --tasks: examples in each prompt (lm-eval's)."),
    include_path: list[str] = typer.Option([], "--include-path", help="With --tasks: a folder of task YAML (lm-eval's); repeatable."),
    task_data: str | None = typer.Option(None, "--task-data", help="With --tasks: task data laid out offline by scripts/prepare_tasks.py DIR (lm-eval's tasks, local data)."),
    context: str | None = typer.Option(None, "--context", help="Lengths, comma-separated (e.g. 2048,8192): samples packed from --dataset to each, --num-samples per length at most; per layer the K/V saturation and absmax past the scales, and ΔNLL on each sample's last quarter."),
    saturation_only: bool = typer.Option(False, "--saturation-only", help="With --context: only the unquantised forward per sample (saturation and absmax against each scale set), no ΔNLL: one forward instead of one per scale set more."),
    needle: bool = typer.Option(False, "--needle", help="With --context: the needle probe instead; a 6-digit key placed at 0-100% depth of held-out text of each length, asked for at the end and greedy-decoded reading the FP8 cache; keys found per length, depth and scale set, paired against the unquantised cache (--plot: the heatmap)."),
    split: str = typer.Option("train", "--split", help="Dataset split."),
    text_column: str | None = typer.Option(None, "--text-column", help="Column with the text."),
    num_samples: int | None = typer.Option(None, "--num-samples", help="First N rows of the split (default 64); with --context, samples per length; with --needle, keys per length and depth (default 4)."),
    max_seq_len: int = typer.Option(512, "--max-seq-len", help="Tokens per sample at most."),
    batch_size: int = typer.Option(2, "--batch-size", help="Sequences per forward pass."),
    seed: int = typer.Option(42, "--seed", help="Shuffle seed."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, bfloat16, float16 or float32."),
    device: Device = "cpu",
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of per-layer absmax, SQNR and clipping."),
    fp8_attention: bool = typer.Option(False, "--fp8-attention", help="Also run every checkpoint that has q_scale as FP8 attention: Q quantised with the target's numerics too, the attention matmuls on the FP8 values in float32."),
    layer_rows: int = typer.Option(2, "--layer-rows", help="Rows on which each layer is quantised alone, for its own ΔNLL (one forward pass per layer and scale set); 0: skip."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Print every layer's attention error, ΔNLL alone, SQNR and clipping."),
    as_json: AsJson = False,
    bf16_compute: Bf16Compute = "auto",
    add_special_tokens: SpecialTokens = None,
    quiet: Quiet = False,
) -> None:
    """Predict FP8-KV accuracy with the chip's own numerics, against an unquantised KV cache."""
    from kvcalib.evaluate.api import eval_options, evaluate
    from kvcalib.evaluate.plot import check_plot_path, plot_eval

    if tasks is not None or dataset is None:
        _eval_tasks(checkpoint, dataset, tasks, target, compare, limit, num_fewshot, include_path, task_data,
                    batch_size, dtype, device, bf16_compute, as_json, quiet)
        return
    options = eval_options(target=target, compare=compare, split=split, text_column=text_column,
                           num_samples=64 if num_samples is None else num_samples, max_seq_len=max_seq_len,
                           batch_size=batch_size, seed=seed, dtype=dtype, device=device, fp8_attention=fp8_attention,
                           bf16_compute=bf16_compute, add_special_tokens=add_special_tokens, layer_rows=layer_rows)
    console = _stderr(quiet)
    if context is not None or needle or saturation_only:
        _eval_context(checkpoint, dataset, context, options, console, as_json, plot, needle, num_samples,
                      not saturation_only)
        return
    with _errors(), progress_bar(console, "evaluating", "eval") as on_progress:
        if plot is not None:
            check_plot_path(plot, [checkpoint, dataset, *compare])
        result = evaluate(checkpoint, dataset, options=options, progress=on_progress)
        if plot is not None:
            result = dataclasses.replace(result, plot=str(plot_eval(result, plot)))
    render_eval(console, result, per_layer)
    if as_json:
        _print_json(result.to_dict())


def _eval_context(checkpoint: str, dataset: str, context: str | None, options: Any, console: Console, as_json: bool,
                  plot: Path | None, needle: bool, keys: int | None, nll: bool = True) -> None:
    """eval --context: saturation and ΔNLL at long context (kvcalib.evaluate.context); with --needle, the needle
    probe (kvcalib.evaluate.needle), `keys` per length and depth (None: its default)."""
    from kvcalib.evaluate.api import evaluate_context, evaluate_needle
    from kvcalib.evaluate.context import parse_lengths
    from kvcalib.evaluate.plot import check_plot_path, plot_needle

    with _errors(), progress_bar(console, "evaluating long context", "eval") as on_progress:
        if context is None or needle and not nll:
            raise UsageError("--needle or --saturation-only runs at the lengths of --context (not both)",
                             hint="e.g. --context 1024,4096 --needle")
        lengths = parse_lengths(context)
        if not needle:
            if plot is not None:
                raise UsageError("--plot with --context draws the needle heatmap: add --needle",
                                 hint="or drop --plot")
            result = evaluate_context(checkpoint, dataset, lengths, options=options, progress=on_progress, nll=nll)
        else:
            if plot is not None:
                check_plot_path(plot, [checkpoint, dataset, *options.compare])
            result = evaluate_needle(checkpoint, dataset, lengths, keys=keys, options=options, progress=on_progress)
            if plot is not None:
                result = dataclasses.replace(result, plot=str(plot_needle(result, plot)))
    (render_needle if needle else render_context)(console, result)
    if as_json:
        _print_json(result.to_dict())


def _eval_tasks(checkpoint: str, dataset: str | None, tasks: str | None, target: str, compare: list[str],
                limit: int | None, num_fewshot: int | None, include_path: list[str], task_data: str | None,
                batch_size: int, dtype: str, device: str, bf16_compute: str, as_json: bool, quiet: bool) -> None:
    """eval --tasks: lm-eval tasks, each run paired against the baseline (kvcalib.evaluate.tasks)."""
    from kvcalib.evaluate.api import evaluate_tasks, task_options

    console = _stderr(quiet)
    with _errors():
        if dataset is not None or tasks is None:
            raise UsageError("eval needs --dataset (held-out text) or --tasks (lm-eval tasks), not both"
                             if dataset is not None else "eval needs --dataset DATA or --tasks TASK[,TASK]",
                             hint="e.g. kvcalib eval CKPT --dataset held-out.jsonl, or --tasks lambada_openai --limit 200")
        options = task_options([t.strip() for t in tasks.split(",") if t.strip()], target=target, compare=compare,
                               limit=limit, num_fewshot=num_fewshot, include_path=tuple(include_path),
                               task_data=task_data, batch_size=batch_size, dtype=dtype, device=device,
                               bf16_compute=bf16_compute)
        with progress_bar(console, "evaluating tasks", "eval") as on_progress:
            result = evaluate_tasks(checkpoint, options.tasks, options=options, progress=on_progress)
    render_tasks(console, result)
    if as_json:
        _print_json(result.to_dict())


@app.command("serve-check")
def serve_check(
    checkpoint: Path = typer.Argument(..., help="Calibrated checkpoint directory to serve."),
    device: str = typer.Option(..., "--device", help="trn2 or trn3 (vLLM on Neuron), cpu (vLLM on CPU) or cuda (vLLM on GPU)."),
    tp: Tp = None,
    max_model_len: MaxModelLen = 2048,
    max_num_seqs: int = typer.Option(4, "--max-num-seqs"),
    port: int | None = typer.Option(None, "--port", help="Port on 127.0.0.1 (default: a free one)."),
    startup_timeout: StartupTimeout = 1800.0,
    stop_timeout: float = typer.Option(60.0, "--stop-timeout", help="Seconds between SIGTERM and SIGKILL."),
    prompts: Path | None = typer.Option(None, "--prompts", help="Prompts: one per line, or .jsonl with 'prompt'."),
    baseline: bool | None = typer.Option(None, "--baseline/--no-baseline", help="Also serve without FP8 KV and compare (default: on for cpu)."),
    vllm_python: VllmPython = Path(sys.executable),
    log_dir: LogDir = None,
    neuron_visible_devices: str | None = typer.Option(None, "--neuron-visible-devices", help="NEURON_VISIBLE_DEVICES for the server, e.g. 0-7."),
    force: bool = typer.Option(False, "--force", help="Serve scales sized for a larger FP8 max than the chip's."),
    canary: bool | None = typer.Option(None, "--canary/--no-canary", help=CANARY_HELP),
    predict: bool = typer.Option(True, "--predict/--no-predict", help=PREDICT_HELP),
    tasks: str | None = typer.Option(None, "--tasks", help="Also run lm-eval tasks (comma-separated) against the baseline and FP8 servers, paired item by item, next to kvcalib's prediction (lm-eval: the 'tasks' extra)."),
    limit: int | None = typer.Option(None, "--limit", help="With --tasks: items per task."),
    task_data: str | None = typer.Option(None, "--task-data", help="With --tasks: offline task data (scripts/prepare_tasks.py DIR)."),
    context: int | None = typer.Option(None, "--context", help="Also send a passkey prompt of about this many tokens (within --max-model-len): the FP8 server must find the key where the baseline does."),
    as_json: AsJson = False,
    quiet: Quiet = False,
) -> None:
    """Serve CKPT with vLLM's FP8 KV cache, probe it, compare with a baseline, and always stop the server."""
    from kvcalib.serve.api import serve_check as run_serve_check, serve_options
    from kvcalib.serve.prompts import read_prompts_file
    from kvcalib.serve.tasks import TaskSpec

    console = _stderr(quiet)
    with _errors(interrupted="every vLLM server serve-check started was stopped"), \
            serve_status(console) as on_event, captured_notes() as notes:
        options = serve_options(
            device, tp=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs, port=port,
            startup_timeout_s=startup_timeout, stop_timeout_s=stop_timeout, baseline=baseline,
            prompts=read_prompts_file(prompts) if prompts else None, vllm_python=vllm_python, log_dir=log_dir,
            neuron_visible_devices=neuron_visible_devices, force=force, canary=canary, predict=predict,
            tasks=TaskSpec.from_flags(tasks, limit, task_data), context=context,
        )
        result = run_serve_check(checkpoint, options=options, progress=on_event)
    render_serve_check(console, result, notes)
    if as_json:
        _print_json(result.to_dict())
    raise typer.Exit(0 if result.ok else 1)


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
