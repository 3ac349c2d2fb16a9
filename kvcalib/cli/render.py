"""What the commands print: the tables and the progress bar (rich, on stderr); serve-check's in render_serve."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcalib.core import fp8
from kvcalib.core.choice import ScaleChoice

if TYPE_CHECKING:  # the results' modules load torch; the CLI imports this module at start
    from kvcalib.calibration.options import CalibrationResult
    from kvcalib.calibration.plan import CalibrationPlan
    from kvcalib.core.progress import Progress as RunProgress
    from kvcalib.evaluation.context import ContextResult
    from kvcalib.evaluation.needle import NeedleResult
    from kvcalib.evaluation.pipeline import EvalResult, RunResult
    from kvcalib.evaluation.significance import Interval
    from kvcalib.evaluation.tasks import TaskResult
    from kvcalib.validation.report import ValidationReport

__all__ = [
    "progress_bar",
    "render_calibration",
    "render_context",
    "render_eval",
    "render_needle",
    "render_plan",
    "render_report",
    "render_tasks",
]


@contextmanager
def progress_bar(
    console: Console, name: str = "calibrate"
) -> Iterator[Callable[[RunProgress], None]]:
    """A progress callback: on a terminal a rich bar, elsewhere (a log, a pipe, CI) plain lines, each how far
    `name` is: `calibrate: 37/128 samples, 18,944 tokens, 69 tok/s, ETA 0:09:12`: a stage's first, and the observing's
    at its start and end and at most every PLAIN_INTERVAL_S between."""
    bar = (
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        if console.is_terminal
        else None
    )
    task = bar.add_task("starting", total=None) if bar else None
    stage = started = last = None
    finished = False

    def on_progress(p: RunProgress) -> None:
        nonlocal stage, started, last, finished
        now, was, stage = time.monotonic(), stage, p.stage
        if bar:
            bar.start()  # at the first progress (again: nothing)
        if p.stage != "observe":
            text = f"{name}: {_STAGES.get(p.stage, p.stage)}"
            if bar:
                bar.update(task, description=text)
            elif p.stage != was:
                _line(console, text)
            return
        started, layers = started or now, p.num_layers
        done = p.tokens_done >= p.tokens_total and (not layers or p.layer + 1 == layers)
        if (
            not bar
            and last is not None
            and now - last < PLAIN_INTERVAL_S
            and (finished or not done)
        ):
            return
        last, finished = now, done
        rate = p.tokens_done / (now - started) if now > started and p.tokens_done else 0.0
        where = f" layer {p.layer + 1}/{layers}," if layers else ""
        eta = _duration((p.tokens_total - p.tokens_done) / rate) if rate else "-"
        text = (
            f"{name}:{where} {p.samples_done}/{p.samples_total} samples, {p.tokens_done:,} tokens, "
            f"{rate:,.0f} tok/s, ETA {eta}"
        )
        if bar:
            bar.update(task, description=text, total=p.tokens_total, completed=p.tokens_done)
        else:
            _line(console, text)

    try:
        yield on_progress
    finally:
        if bar and bar.live.is_started:
            bar.stop()


# Without a terminal: one line at most this often, and at the start and the end of the work.
PLAIN_INTERVAL_S = 30.0
_STAGES = {
    "load-data": "reading dataset",
    "load-model": "loading model",
    "objective": "choosing the scales",
    "write": "writing checkpoint",
    "layers-alone": "quantising one layer at a time",
}


def _line(console: Console, text: str, **style: Any) -> None:
    """`text` as it is (no markup, no highlighting), wrapped by the terminal rather than by rich."""
    console.print(text, soft_wrap=True, markup=False, highlight=False, **style)


def _table(
    console: Console,
    title: str,
    columns: Iterable[str],
    rows: Iterable[Iterable[str]],
    left: Iterable[str] = (),
) -> None:
    """Print a table titled `title` (no markup) with `columns` (right-justified but those in `left`; a long cell
    folds), `rows`."""
    table = Table(title=escape(title))
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0))))  # 0:09:12


def _chosen(choice: ScaleChoice | None) -> str:
    """The table's "chosen" cell: the candidate."""
    return choice.label.replace("absmax x", "x") if choice else ""


def render_calibration(console: Console, result: CalibrationResult, notes: list[str]) -> None:
    """The scales table and what calibrate says of them; `notes`: the kvcalib logger's records."""
    per_head = any(layer.k.head_scales is not None for layer in result.layers)
    queries = any(layer.q is not None for layer in result.layers)
    searched = result.scale_objective != "absmax"
    rule = (
        f"the {result.scale_objective} objective (FP8 max {result.fp8_max:g})"
        if searched
        else f"absmax / {result.fp8_max:g}"
    )
    _table(
        console,
        f"{'per-head ' if per_head else ''}KV scales for {result.target}: {rule}"
        + (" (each layer's largest head; every head's in --json)" if per_head else ""),
        (
            "layer",
            "k absmax",
            "v absmax",
            "k_scale",
            "v_scale",
            *(("k chosen", "v chosen") if searched else ()),
            *(("q absmax", "q_scale") if queries else ()),
        ),
        (
            (
                str(layer.layer),
                *(
                    f"{x:.4g}"
                    for x in (layer.k.absmax, layer.v.absmax, layer.k.scale, layer.v.scale)
                ),
                *(_chosen(s.choice) for s in (layer.k, layer.v) if searched),
                *((f"{layer.q.absmax:.4g}", f"{layer.q.scale:.4g}") if queries else ()),
            )
            for layer in result.layers
        ),
    )
    for note in notes:
        console.print(f"[yellow]warning:[/] {note}", soft_wrap=True)
    if result.validation is not None:
        n_warn = len(result.validation.warnings)
        console.print(
            f"validation: [green]ok[/] for {result.target}"
            + (f" ({n_warn} warning(s))" if n_warn else "")
        )
    _line(console, f"compute: {result.compute}")
    if result.kv_cache is not None:
        _line(console, f"KV cache: {result.kv_cache.describe()}")
    _line(
        console,
        f"wrote {result.output}: {result.num_samples} samples, {result.num_tokens:,} tokens, "
        f"{result.tokens_per_s:,.0f} tok/s, {result.seconds:.1f} s in all",
    )
    _line(console, f"tokens: {result.token_budget}")  # why that many


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def render_plan(console: Console, plan: CalibrationPlan) -> None:
    """calibrate --plan: what would stop the run, else the engine, memory, disk and the estimated time."""
    for refusal in plan.refusals:
        console.print(f"[red]calibrate would stop:[/] {escape(refusal)}", soft_wrap=True)
    if not plan.refusals:
        est, probe = plan.estimate, plan.probe
        available = (
            f"{_size(plan.memory_limit_bytes)}, {plan.memory_source}"
            if plan.memory_limit_bytes
            else "unknown"
        )
        rows = {
            "target": plan.target,
            "engine": plan.engine + (f" ({plan.engine_reason})" if plan.engine_reason else ""),
            "compute": plan.compute,
            "samples": f"{plan.num_samples:,} ({plan.num_tokens:,} tokens: {plan.token_budget}), "
            f"{plan.num_layers} layers",
            "peak memory": f"~{_size(plan.peak_memory_bytes)} (weights {_size(plan.weight_bytes)}; "
            f"available {available})",
            "output": f"{_size(plan.output_bytes)} new, weights "
            f"{'hard-linked' if plan.weights_linked else 'copied'}; {_size(plan.free_bytes)} free",
            "scratch": _size(plan.scratch_bytes) if plan.scratch_bytes else "none",
            "KV cache": plan.kv_cache.describe()
            if plan.kv_cache
            else "unknown (config.json's layers, heads, head_dim)",
            "probe": f"{probe.batches} batch(es), {probe.layers} layer(s), {probe.tokens:,} tokens: "
            f"{probe.seconds:.1f} s",
            "estimate": f"{_duration(est.total)} (load {est.load:.0f} s, observe {est.observe:.0f} s, "
            f"objective {est.objective:.0f} s, write {est.write:.0f} s)",
        }
        table = Table(
            title=f"calibrate --plan: {escape(plan.model)} -> {escape(plan.output)}",
            show_header=False,
        )
        table.add_column("", style="bold")
        table.add_column("", overflow="fold")
        for name, value in rows.items():
            table.add_row(name, escape(str(value)))
        console.print(table)
    console.print("plan: nothing written")


def render_report(console: Console, report: ValidationReport) -> None:
    if report.findings:
        columns = ("rule", "severity", "where", "message", "hint")
        colors = {"error": "red", "warning": "yellow", "info": "cyan"}
        rows = (
            (
                f.rule,
                f"[{colors[f.severity]}]{f.severity}[/]",
                f.location or "",
                f.message,
                f.hint or "",
            )
            for f in report.findings
        )
        title = f"validate {report.checkpoint} for {report.target}"
        _table(console, title, columns, rows, columns)
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(
        f"{verdict}: {len(report.errors)} error(s), {len(report.warnings)} warning(s)"
        + (" (strict: warnings count as errors)" if report.strict else "")
    )


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _spread(interval: Interval | None, fmt: str = "+.4f") -> str:
    """An interval as `estimate [low, high]`; "-" for none."""
    if interval is None:
        return "-"
    return f"{interval.estimate:{fmt}} [{interval.low:{fmt}}, {interval.high:{fmt}}]"


def _worst(layers: Iterable[Any], name: str, fmt: str) -> str:
    """The layers' largest `name` and its layer; "-" where none measured it."""
    value, layer = max(
        ((getattr(s, name), s.layer) for s in layers if getattr(s, name) is not None),
        default=(None, 0),
    )
    return "-" if value is None else f"{value:{fmt}} (layer {layer})"


def render_eval(console: Console, result: EvalResult, per_layer: bool = False) -> None:
    _table(
        console,
        f"FP8 KV on {result.target} vs an unquantised KV cache (NLL {result.baseline_nll:.4f}, "
        f"PPL {math.exp(result.baseline_nll):.3f}), {result.num_tokens:,} tokens",
        (
            "scales",
            "kind",
            "ΔNLL",
            "KL",
            "top-1",
            "K clip",
            "V clip",
            "attn err",
            "layer alone",
            "K SQNR",
            "V SQNR",
            "Q SQNR",
        ),
        (
            (
                run.name,
                run.kind,
                f"{run.delta_nll:+.4f}",
                f"{run.kl:.5f}",
                f"{run.top1:.2%}",
                f"{run.k_clipped:.2%}",
                f"{run.v_clipped:.2%}",
                _worst(run.layers, "attention_error", ".3f"),
                _worst(run.layers, "kl_alone", ".5f"),
                f"{min(s.k.sqnr_db for s in run.layers):.1f}",
                f"{min(s.v.sqnr_db for s in run.layers):.1f}",
                _num(min((s.q.sqnr_db for s in run.layers if s.q), default=None), ".1f"),
            )
            for run in result.runs
        ),
        ("scales", "kind"),
    )
    order = {
        fp8.NEURON_ORDER: "Neuron order (prefill reads fresh K/V, decode reads FP8; decode steps scored)",
        fp8.NEURON_CHUNKED_ORDER: "chunked Neuron order (the prompt in 128-token pieces, each reading the earlier "
        "ones from FP8; decode reads FP8; decode steps scored)",
        fp8.MXFP8_ORDER: "Neuron order over Trainium 3's MXFP8 KV cache (no per-tensor scale is used: every scale set "
        "scores alike; decode steps scored)",
    }.get(result.order, "GPU order (every position reads FP8)")
    _line(console, f"scored in the {order}")
    methods = []
    for run in result.runs:
        for interval, what, fmt in (
            (run.delta_nll_interval, "ΔNLL (nats)", "{:+.4f}"),
            (run.delta_accuracy_interval, "next-token top-1 accuracy", "{:+.2%}"),
        ):
            if interval:
                _line(console, f"{run.name}: {what}: {interval.verdict(fmt)}")
                methods.append(interval.method)
    if methods:
        _line(console, f"intervals: {methods[0]}, sequences whole, per-token means", style="dim")
    if per_layer:
        for run in result.runs:
            _render_layers(console, run, result.layer_rows)
    alone = (
        f"layer alone: the costliest layer's KL with only its K/V quantised, on the first "
        f"{result.layer_rows} row(s) (its ΔNLL with --per-layer); "
        if result.layer_rows
        else ""
    )
    console.print(
        "attn err: the worst layer's attention-output error ||ΔO||/||O|| with K and V quantised (what "
        f"serving sees); {alone}SQNR (dB): the worst layer's, which can rank scales backwards; every "
        "layer's with --per-layer, in --json and --plot",
        style="dim",
    )
    _line(console, f"compute: {result.compute}")
    if result.plot:
        _line(console, f"plot: {result.plot}")


def render_context(console: Console, result: ContextResult) -> None:
    """eval-context: per length and scale set, ΔNLL on the last quarter, and the worst layer's saturation."""
    _table(
        console,
        f"FP8 KV on {result.target} at long context: {result.tokens_available:,} tokens of text packed "
        f"(model's max {result.max_positions or '?'}, memory's {result.memory_bound:,})",
        (
            "length",
            "scales",
            "samples",
            "base NLL",
            "ΔNLL last quarter [95%]",
            "K clipped",
            "V clipped",
            "K absmax/clip",
            "V absmax/clip",
        ),
        (
            (
                f"{row.length:,}",
                escape(row.name),
                str(row.samples),
                f"{row.baseline_nll:.4f}",
                _num(row.delta_nll, "+.4f")
                + (f" [{i.low:+.4f}, {i.high:+.4f}]" if (i := row.delta_nll_interval) else ""),
                f"{row.k_clipped:.3%}",
                f"{row.v_clipped:.3%}",
                *(f"{ratio:.2f} (L{layer})" for ratio, layer in map(row.beyond, ("k", "v"))),
            )
            for row in result.rows
        ),
        ("scales",),
    )
    console.print(
        "ΔNLL on the last quarter of each sample's positions; interval: paired bootstrap over 64-token "
        "blocks of them. Clipped: the worst layer's fraction of elements that saturate; absmax/clip: the "
        "worst layer's absmax over the largest value its scale represents (above 1: past the scales)",
        style="dim",
    )


def render_needle(console: Console, result: NeedleResult) -> None:
    """eval-needle: keys found per length and scale set, by depth, and the paired verdict."""
    _table(
        console,
        f"needle retrieval with FP8 KV on {result.target} (prefill attends to the "
        f"{result.prefill}; decoding reads the FP8 cache)",
        (
            "length",
            "scales",
            "found",
            "rate [Wilson 95%]",
            *(f"depth {d:.0%}" for d in result.depths),
            "difference [95%]",
            "verdict",
        ),
        (
            (
                f"{row.length:,}",
                escape(row.name),
                f"{row.found}/{row.trials}",
                f"{row.rate:.0%} [{row.rate_interval[0]:.0%}, {row.rate_interval[1]:.0%}]",
                *(f"{f}/{n}" for _, f, n in row.by_depth),
                _spread(row.difference, "+.1%"),
                escape(row.verdict()),
            )
            for row in result.rows
        ),
        ("scales", "verdict"),
    )
    _line(
        console,
        "a trial is found when the key's 6 digits are in the greedy answer; difference: paired bootstrap "
        "over trials (2000 resamples, seed 0) of the run's hits minus the unquantised cache's"
        + (f"; heatmap: {result.plot}" if result.plot else ""),
        style="dim",
    )


def render_tasks(console: Console, result: TaskResult) -> None:
    """eval-tasks: per task and metric, the baseline's score, each run's, and its paired verdict."""
    _table(
        console,
        f"lm-eval tasks with FP8 KV on {result.target} vs an unquantised KV cache"
        + (f", {result.limit} items per task at most" if result.limit else ""),
        (
            "task",
            "metric",
            "items",
            "baseline",
            "scales",
            "score",
            "difference (95% interval)",
            "verdict",
        ),
        (
            (
                row.task,
                f"{row.metric} ({row.filter})",
                str(row.items),
                f"{row.baseline:.4f}",
                name,
                f"{score:.4f}",
                _spread(row.intervals.get(name)),
                escape(row.verdict(name, cell=True)),
            )
            for row in result.rows
            for name, score in row.scores.items()
        ),
        ("task", "metric", "scales", "verdict"),
    )
    console.print(
        "intervals: paired bootstrap over the task's items (2000 resamples, seed 0) of the run's score "
        "minus the baseline's on the same item",
        style="dim",
    )
    _line(console, f"compute: {result.compute}; lm-eval {result.lm_eval}")


def _render_layers(console: Console, run: RunResult, layer_rows: int) -> None:
    """One run's figures layer by layer: attention error and ΔNLL alone next to SQNR and clipping; the scale the
    checkpoint's objective chose."""
    chosen = any(s.chosen for s in run.layers)
    _table(
        console,
        f"{run.name}: per layer"
        + (
            f" (alone: that layer quantised, the others not, on {layer_rows} row(s))"
            if layer_rows
            else ""
        ),
        (
            "layer",
            "attn err",
            "ΔNLL alone",
            "KL alone",
            "K SQNR",
            "V SQNR",
            "K clip",
            "V clip",
            "K clips above",
            "K absmax",
            *(("K chosen", "V chosen") if chosen else ()),
        ),
        (
            (
                str(s.layer),
                _num(s.attention_error, ".3f"),
                _num(s.delta_nll_alone, "+.4f"),
                _num(s.kl_alone, ".5f"),
                f"{s.k.sqnr_db:.1f}",
                f"{s.v.sqnr_db:.1f}",
                f"{s.k.clipped:.2%}",
                f"{s.v.clipped:.2%}",
                f"{s.k.clip_at:.4g}",
                f"{s.k.absmax:.4g}",
                *(_chosen((s.chosen or {}).get(kind)) for kind in "kv" if chosen),
            )
            for s in run.layers
        ),
    )
