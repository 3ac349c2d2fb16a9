"""What the commands print: the tables and the progress bar (rich, on stderr); serve-check's in render_serve."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
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
    console: Console, label: str = "calibrating", name: str = "calibrate"
) -> Iterator[Callable[[RunProgress], None]]:
    """A progress callback: the rich bar on a terminal, plain `name: ...` lines elsewhere (a log, a pipe, CI)."""
    if not console.is_terminal:
        yield plain_progress(console, name)
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[samples]} samples"),
        TextColumn("{task.fields[tokens]} tok"),
        TextColumn("{task.fields[rate]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task("starting", total=None, samples="-", tokens="-", rate="-")
    observe_started: list[float] = []

    def on_progress(p: RunProgress) -> None:
        if not bar.live.is_started:
            bar.start()
        if p.stage != "observe":
            bar.update(task, description=_STAGES.get(p.stage, p.stage))
            return
        if not observe_started:
            observe_started.append(time.perf_counter())
        elapsed = time.perf_counter() - observe_started[0]
        rate = f"{p.tokens_done / elapsed:,.0f}" if elapsed > 0 and p.tokens_done else "-"
        where = f" layer {p.layer + 1}/{p.num_layers}" if p.num_layers else ""
        bar.update(
            task,
            description=label + where,
            total=p.tokens_total,
            completed=p.tokens_done,
            samples=f"{p.samples_done}/{p.samples_total}",
            tokens=f"{p.tokens_done:,}/{p.tokens_total:,}",
            rate=rate,
        )

    try:
        yield on_progress
    finally:
        if bar.live.is_started:
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


def plain_progress(console: Console, name: str) -> Callable[[RunProgress], None]:
    """Progress as plain lines: `calibrate: 37/128 samples, 18,944 tokens, 69 tok/s, ETA 9m12s`."""
    state: dict[str, Any] = {"stage": None, "started": None, "last": None, "finished": False}

    def on_progress(p: RunProgress) -> None:
        now = time.monotonic()
        if p.stage != "observe":
            if p.stage != state["stage"]:
                console.print(
                    f"{name}: {_STAGES.get(p.stage, p.stage)}", markup=False, highlight=False
                )
            state["stage"] = p.stage
            return
        state["stage"] = "observe"
        state["started"] = state["started"] or now
        layers = p.num_layers
        finished = p.tokens_done >= p.tokens_total and (not layers or p.layer + 1 == layers)
        due = (
            state["last"] is None
            or now - state["last"] >= PLAIN_INTERVAL_S
            or (finished and not state["finished"])
        )
        if not due:
            return
        state["last"], state["finished"] = now, finished
        elapsed = now - state["started"]
        rate = p.tokens_done / elapsed if elapsed > 0 and p.tokens_done else 0.0
        where = f" layer {p.layer + 1}/{layers}," if layers else ""
        eta = _duration((p.tokens_total - p.tokens_done) / rate) if rate else "-"
        console.print(
            f"{name}:{where} {p.samples_done}/{p.samples_total} samples, {p.tokens_done:,} tokens, "
            f"{rate:,.0f} tok/s, ETA {eta}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    return on_progress


def _table(title: str, columns: Iterable[str], left: Iterable[str] = (), **column: Any) -> Table:
    """A table titled `title` with `columns`, right-justified but those in `left`."""
    table = Table(title=title)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", **column)
    return table


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return (
        (f"{hours}h" if hours else "")
        + (f"{rest // 60}m" if hours or rest >= 60 else "")
        + f"{rest % 60}s"
    )


def _chosen(choice: ScaleChoice | None) -> str:
    """The table's "chosen" cell: the candidate."""
    return choice.label.replace("absmax x", "x") if choice else ""


def _print_objective(console: Console, result: CalibrationResult) -> None:
    """The clipped or widened scales."""
    clipped = [
        f"layer {layer.layer} {kind.upper()} {s.choice.label}"
        for layer in result.layers
        for kind, s in layer.kinds().items()
        if s.choice and s.choice.label != "absmax"
    ]
    console.print(
        f"scale objective: {result.scale_objective}; not absmax / {result.fp8_max:g}: "
        + (", ".join(clipped) if clipped else "none (no clip halves any layer's attention error)"),
        soft_wrap=True,
        markup=False,
    )


def render_calibration(console: Console, result: CalibrationResult, notes: list[str]) -> None:
    """The scales table and what calibrate says of them; `notes`: the kvcalib logger's records."""
    per_head = any(layer.k.head_scales is not None for layer in result.layers)
    queries = any(layer.q is not None for layer in result.layers)
    searched = result.scale_objective != "absmax"
    rule = (
        f"the {result.scale_objective} objective (FP8 max {result.fp8_max:g})"
        if searched
        else "absmax / " + f"{result.fp8_max:g}"
    )
    table = _table(
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
    )
    for layer in result.layers:
        k, v, q = layer.k, layer.v, (layer.q.absmax, layer.q.scale) if queries else ()
        chosen = tuple(_chosen(s.choice) for s in (k, v)) if searched else ()
        table.add_row(
            str(layer.layer),
            *(f"{x:.4g}" for x in (k.absmax, v.absmax, k.scale, v.scale)),
            *chosen,
            *(f"{x:.4g}" for x in q),
        )
    console.print(table)
    if searched:
        _print_objective(console, result)
    for note in notes:
        console.print(f"[yellow]warning:[/] {note}", soft_wrap=True)
    if result.validation is not None:
        n_warn = len(result.validation.warnings)
        console.print(
            f"validation: [green]ok[/] for {result.target}"
            + (f" ({n_warn} warning(s))" if n_warn else "")
        )
    console.print(f"compute: {result.compute}", soft_wrap=True, markup=False)
    if result.kv_cache is not None:
        console.print(f"KV cache: {result.kv_cache.describe()}", soft_wrap=True, markup=False)
    console.print(
        f"wrote {result.output}: {result.num_samples} samples, {result.num_tokens:,} tokens, "
        f"{result.tokens_per_s:,.0f} tok/s, {result.seconds:.1f} s in all"
    )
    console.print(f"tokens: {result.token_budget}", soft_wrap=True, markup=False)  # why that many


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def render_plan(console: Console, plan: CalibrationPlan) -> None:
    """calibrate --plan: what would stop the run, else the engine, memory, disk and the estimated time."""
    if plan.refusals:
        for refusal in plan.refusals:
            console.print(f"[red]calibrate would stop:[/] {escape(refusal)}", soft_wrap=True)
        console.print("plan: nothing written")
        return
    est, probe = plan.estimate, plan.probe
    available = (
        f"{_size(plan.memory_limit_bytes)}, {plan.memory_source})"
        if plan.memory_limit_bytes
        else "unknown)"
    )
    rows = [
        ("target", plan.target),
        ("engine", plan.engine + (f" ({plan.engine_reason})" if plan.engine_reason else "")),
        ("compute", plan.compute),
        (
            "samples",
            f"{plan.num_samples:,} ({plan.num_tokens:,} tokens: {plan.token_budget}), "
            f"{plan.num_layers} layers",
        ),
        (
            "peak memory",
            f"~{_size(plan.peak_memory_bytes)} (weights {_size(plan.weight_bytes)}; available {available}",
        ),
        (
            "output",
            f"{_size(plan.output_bytes)} new, weights {'hard-linked' if plan.weights_linked else 'copied'}; "
            f"{_size(plan.free_bytes)} free",
        ),
        ("scratch", _size(plan.scratch_bytes) if plan.scratch_bytes else "none"),
        (
            "KV cache",
            plan.kv_cache.describe()
            if plan.kv_cache
            else "unknown (config.json's layers, heads, head_dim)",
        ),
        (
            "probe",
            f"{probe.batches} batch(es), {probe.layers} layer(s), {probe.tokens:,} tokens: "
            f"{probe.seconds:.1f} s",
        ),
        (
            "estimate",
            f"{_duration(est.total)} (load {est.load:.0f} s, observe {est.observe:.0f} s, objective "
            f"{est.objective:.0f} s, write {est.write:.0f} s)",
        ),
    ]
    table = Table(
        title=f"calibrate --plan: {escape(plan.model)} -> {escape(plan.output)}", show_header=False
    )
    table.add_column("", style="bold")
    table.add_column("", overflow="fold")
    for name, value in rows:
        table.add_row(name, escape(str(value)))
    console.print(table)
    console.print("plan: nothing written")


def render_report(console: Console, report: ValidationReport) -> None:
    if report.findings:
        columns = ("rule", "severity", "where", "message", "hint")
        table = _table(
            f"validate {report.checkpoint} for {report.target}", columns, columns, overflow="fold"
        )
        colors = {"error": "red", "warning": "yellow", "info": "cyan"}
        for f in report.findings:
            table.add_row(
                f.rule,
                f"[{colors.get(f.severity, 'white')}]{f.severity}[/]",
                f.location or "",
                f.message,
                f.hint or "",
            )
        console.print(table)
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


def _worst(values: list[tuple[float, int]], fmt: str) -> str:
    return "-" if not values else (fmt + " (layer {})").format(*max(values))


def render_eval(console: Console, result: EvalResult, per_layer: bool = False) -> None:
    table = _table(
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
        ("scales", "kind"),
        overflow="fold",
    )
    for run in result.runs:
        q = [s.q.sqnr_db for s in run.layers if s.q is not None]
        table.add_row(
            run.name,
            run.kind,
            f"{run.delta_nll:+.4f}",
            f"{run.kl:.5f}",
            f"{run.top1:.2%}",
            f"{run.k_clipped:.2%}",
            f"{run.v_clipped:.2%}",
            _worst(
                [(s.attention_error, s.layer) for s in run.layers if s.attention_error is not None],
                "{:.3f}",
            ),
            _worst([(s.kl_alone, s.layer) for s in run.layers if s.kl_alone is not None], "{:.5f}"),
            f"{min(s.k.sqnr_db for s in run.layers):.1f}",
            f"{min(s.v.sqnr_db for s in run.layers):.1f}",
            f"{min(q):.1f}" if q else "-",
        )
    console.print(table)
    order = (
        "Neuron order (prefill reads fresh K/V, decode reads FP8; decode steps scored)"
        if result.order == fp8.NEURON_ORDER
        else "GPU order (every position reads FP8)"
    )
    console.print(f"scored in the {order}", soft_wrap=True, highlight=False)
    for run in result.runs:
        nll, accuracy = run.intervals
        for interval, what, fmt in (
            (nll, "ΔNLL (nats)", "{:+.4f}"),
            (accuracy, "next-token top-1 accuracy", "{:+.2%}"),
        ):
            if interval is not None:
                console.print(
                    f"{escape(run.name)}: {what}: {escape(interval.verdict(fmt))}",
                    soft_wrap=True,
                    highlight=False,
                )
    if any(i is not None for run in result.runs for i in run.intervals):
        console.print(
            f"intervals: {result.runs[0].intervals[0].method if result.runs[0].intervals[0] else ''}, "
            "sequences whole, per-token means",
            style="dim",
        )
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
    console.print(f"compute: {result.compute}", soft_wrap=True, markup=False)
    if result.plot:
        console.print(f"plot: {result.plot}")


def render_context(console: Console, result: ContextResult) -> None:
    """eval --context: per length and scale set, ΔNLL on the last quarter, and the worst layer's saturation."""
    table = _table(
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
        ("scales",),
        overflow="fold",
    )
    for row in result.rows:
        spread = (
            "" if row.interval is None else f" [{row.interval.low:+.4f}, {row.interval.high:+.4f}]"
        )
        delta = "-" if row.delta_nll is None else f"{row.delta_nll:+.4f}{spread}"
        table.add_row(
            f"{row.length:,}",
            escape(row.name),
            str(row.samples),
            f"{row.baseline_nll:.4f}",
            delta,
            f"{row.k_clipped:.3%}",
            f"{row.v_clipped:.3%}",
            *(f"{ratio:.2f} (L{layer})" for ratio, layer in map(row.beyond, ("k", "v"))),
        )
    console.print(table)
    console.print(
        "ΔNLL on the last quarter of each sample's positions; interval: paired bootstrap over 64-token "
        "blocks of them. Clipped: the worst layer's fraction of elements that saturate; absmax/clip: the "
        "worst layer's absmax over the largest value its scale represents (above 1: past the scales)",
        style="dim",
    )


def render_needle(console: Console, result: NeedleResult) -> None:
    """eval --context --needle: keys found per length and scale set, by depth, and the paired verdict."""
    table = _table(
        escape(
            f"needle retrieval with FP8 KV on {result.target} (prefill attends to the "
            f"{result.prefill}; decoding reads the FP8 cache)"
        ),
        (
            "length",
            "scales",
            "found",
            "rate [Wilson 95%]",
            *(f"depth {d:.0%}" for d in result.depths),
            "difference [95%]",
            "verdict",
        ),
        ("scales", "verdict"),
        overflow="fold",
    )
    for row in result.rows:
        low, high = row.rate_interval
        table.add_row(
            f"{row.length:,}",
            escape(row.name),
            f"{row.found}/{row.trials}",
            f"{row.rate:.0%} [{low:.0%}, {high:.0%}]",
            *(f"{f}/{n}" for _, f, n in row.by_depth),
            _spread(row.interval, "+.1%"),
            escape(row.verdict(cell=True)),
        )
    console.print(table)
    console.print(
        "a trial is found when the key's 6 digits are in the greedy answer; difference: paired bootstrap "
        "over trials (2000 resamples, seed 0) of the run's hits minus the unquantised cache's"
        + (f"; heatmap: {result.plot}" if result.plot else ""),
        style="dim",
        soft_wrap=True,
    )


def render_tasks(console: Console, result: TaskResult) -> None:
    """eval --tasks: per task and metric, the baseline's score, each run's, and its paired verdict."""
    table = _table(
        escape(
            f"lm-eval tasks with FP8 KV on {result.target} vs an unquantised KV cache"
            + (f", {result.limit} items per task at most" if result.limit else "")
        ),
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
        ("task", "metric", "scales", "verdict"),
        overflow="fold",
    )
    for row in result.rows:
        for name, score in row.scores.items():
            table.add_row(
                row.task,
                f"{row.metric} ({row.filter})",
                str(row.items),
                f"{row.baseline:.4f}",
                name,
                f"{score:.4f}",
                _spread(row.intervals.get(name)),
                escape(row.verdict(name, cell=True)),
            )
    console.print(table)
    console.print(
        "intervals: paired bootstrap over the task's items (2000 resamples, seed 0) of the run's score "
        "minus the baseline's on the same item",
        style="dim",
    )
    console.print(
        f"compute: {result.compute}; lm-eval {result.lm_eval_version}", soft_wrap=True, markup=False
    )


def _render_layers(console: Console, run: RunResult, layer_rows: int) -> None:
    """One run's figures layer by layer: attention error and ΔNLL alone next to SQNR and clipping; the scale the
    checkpoint's objective chose."""
    chosen = any(s.chosen for s in run.layers)
    table = _table(
        escape(
            f"{run.name}: per layer"
            + (
                f" (alone: that layer quantised, the others not, on {layer_rows} row(s))"
                if layer_rows
                else ""
            )
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
    )
    for s in run.layers:
        table.add_row(
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
    console.print(table)
