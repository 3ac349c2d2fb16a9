"""What serve-check prints: its live status while a server starts, and its tables (rich, on stderr)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from kvcalib.cli.render import PLAIN_INTERVAL_S, _num, _spread, _table

if TYPE_CHECKING:
    from kvcalib.serving.pipeline import PromptResult, ServeCheckResult, ServeEvent
    from kvcalib.serving.predict import DeltaIntervals
    from kvcalib.serving.tasks import ServedTaskRow

__all__ = ["render_serve_check", "serve_status"]


@contextmanager
def serve_status(console: Console) -> Iterator[Callable[[ServeEvent], None]]:
    """Live status on stderr: the command, then elapsed time and the log's last line while waiting."""
    status = console.status("", spinner="dots") if console.is_terminal else None
    last_print = [0.0]

    def on_event(event: ServeEvent) -> None:
        if event.stage == "launch":
            console.print(
                f"{event.server} server: {event.message}",
                soft_wrap=True,
                markup=False,
                style="bold",
            )
            if status is not None:
                status.start()
        elif event.stage == "wait":
            line = f"{event.server}: waiting for /health, {event.elapsed_s:.0f} s | {event.message[-100:]}"
            if status is not None:
                status.update(line)
            elif (
                event.elapsed_s - last_print[0] >= PLAIN_INTERVAL_S
                or event.elapsed_s < last_print[0]
            ):
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


def _problem(p: PromptResult) -> str:
    if p.problem is None:
        return ""
    if not p.failed:
        return f" [yellow]{escape(p.problem)}, as the baseline's[/]"
    return f" [red]{escape(p.problem)}[/]"


def render_serve_check(console: Console, result: ServeCheckResult, notes: list[str]) -> None:
    """serve-check's table, its variants and tasks, then `notes` (the kvcalib logger's records), failures, verdict."""
    columns = ("prompt", "output (FP8 KV)", "baseline", "agreement")
    table = _table(
        escape(f"serve-check {result.checkpoint} on {result.device}"),
        columns,
        columns,
        overflow="fold",
    )
    for p in result.prompts:
        agreement = "-" if p.agreement is None else f"{p.agreement:.2f}"
        table.add_row(
            escape(p.label or p.prompt),
            escape(repr(p.output)),
            "-" if p.baseline_output is None else escape(repr(p.baseline_output)),
            agreement + _problem(p),
        )
    console.print(table)
    nll = f"NLL fp8 {result.nll_fp8:.3f}" + (
        "" if result.nll_baseline is None else f", baseline {result.nll_baseline:.3f}"
    )
    agreement = "" if result.agreement is None else f", mean agreement {result.agreement:.2f}"
    baseline_ready = (
        "" if result.baseline_ready_s is None else f" (baseline {result.baseline_ready_s:.1f} s)"
    )
    console.print(
        f"ready in {result.ready_s:.1f} s{baseline_ready}; {nll}{agreement}; log {escape(result.log)}"
    )
    if result.kv_capacity:  # as vLLM logged it (serving.server.kv_capacity)
        console.print(
            "KV cache vLLM logged: "
            + "; ".join(
                f"{name} not logged"
                if c.tokens is None
                else f"{name} {c.tokens:,} tokens ({_num(c.max_concurrency, '.2f')}x --max-model-len requests)"
                for name, c in result.kv_capacity.items()
            ),
            soft_wrap=True,
            markup=False,
        )
    if result.canary is not None or result.prediction is not None:
        render_variants(console, result)
    if result.tasks:
        render_served_tasks(console, result.tasks)
    for note in notes:
        console.print(f"[yellow]warning:[/] {escape(note)}", soft_wrap=True)
    for failure in result.failures:
        console.print(f"[red]failed:[/] {escape(failure)}", soft_wrap=True)
    console.print("[bold green]PASSED[/]" if result.ok else "[bold red]FAILED[/]")


def render_served_tasks(console: Console, rows: tuple[ServedTaskRow, ...]) -> None:
    """serve-check --tasks: served baseline and FP8 scores with the paired interval, and kvcalib's prediction."""
    table = _table(
        "lm-eval tasks served (FP8 vs baseline, same items) and predicted by kvcalib",
        (
            "task",
            "metric",
            "items",
            "served baseline",
            "served FP8",
            "served difference",
            "predicted baseline",
            "predicted FP8",
            "predicted difference",
        ),
        ("task", "metric"),
        overflow="fold",
    )
    for row in rows:
        served, predicted = row.served, row.predicted
        table.add_row(
            row.task,
            f"{row.metric} ({row.filter})",
            str(row.items),
            f"{served.baseline:.4f}",
            f"{served.fp8:.4f}",
            _spread(served.interval),
            "-" if predicted is None else f"{predicted.baseline:.4f}",
            "-" if predicted is None else f"{predicted.fp8:.4f}",
            _spread(predicted and predicted.interval),
        )
    console.print(table)
    for row in rows:
        console.print(
            f"{row.task} {row.metric}: served {escape(row.served.verdict)}",
            soft_wrap=True,
            highlight=False,
        )


def render_variants(console: Console, result: ServeCheckResult) -> None:
    """Calibrated vs 1.0 vs the canary: what each server measured, and what kvcalib predicted."""
    table = _table(
        "KV scales served: NLL of the probe text, agreement with the baseline, ΔNLL vs the baseline",
        ("scales", "NLL", "agreement", "served ΔNLL", "predicted ΔNLL"),
        ("scales",),
    )
    for row in result.variants():
        table.add_row(
            row["name"],
            _num(row["nll"], ".4f"),
            _num(row["agreement"], ".2f"),
            _num(row["served_delta_nll"], "+.4f"),
            _num(row["predicted_delta_nll"], "+.4f"),
        )
    console.print(table)
    _render_delta_intervals(console, result.intervals)
    if result.canary is not None:
        color = "green" if result.canary.ok else "red"
        console.print(
            f"canary: [{color}]{'ok' if result.canary.ok else 'FAILED'}[/] {escape(result.canary.reason)}",
            soft_wrap=True,
        )


def _render_delta_intervals(console: Console, intervals: DeltaIntervals) -> None:
    """The calibrated scales' ΔNLL on the probe text, served and predicted, with their 95 % intervals."""
    shown = {name: found for name, found in intervals.__dict__.items() if found is not None}
    if not shown:
        return
    words = {
        "served": "served ΔNLL",
        "predicted": "predicted ΔNLL",
        "served_minus_predicted": "served - predicted",
    }
    parts = [
        f"{words[name]} {_spread(found)} ({found.items} blocks)" for name, found in shown.items()
    ]
    method = next(iter(shown.values())).method
    console.print(
        f"calibrated scales, approximate 95% intervals ({method}): " + "; ".join(parts),
        soft_wrap=True,
        highlight=False,
    )
