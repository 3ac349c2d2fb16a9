"""What serve-check prints: its live status while a server starts, and its tables (rich, on stderr)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from kvcalib.cli.render import PLAIN_INTERVAL_S, _line, _num, _spread, _table

if TYPE_CHECKING:
    from kvcalib.serving.pipeline import PromptResult, ServeCheckResult, ServeEvent
    from kvcalib.serving.tasks import ServedTaskRow

__all__ = ["render_serve_check", "serve_status"]


@contextmanager
def serve_status(console: Console) -> Iterator[Callable[[ServeEvent], None]]:
    """Live status on stderr: the command, then elapsed time and the log's last line while waiting."""
    status = console.status("", spinner="dots") if console.is_terminal else None
    last_print = [0.0]

    def on_event(event: ServeEvent) -> None:
        if event.stage == "launch":
            _line(console, f"{event.server} server: {event.message}", style="bold")
            if status:
                status.start()
        elif event.stage == "wait":
            line = f"{event.server}: waiting for /health, {event.elapsed_s:.0f} s | {event.message[-100:]}"
            if status:
                status.update(escape(line))
            elif not 0 <= event.elapsed_s - last_print[0] < PLAIN_INTERVAL_S:
                last_print[0] = event.elapsed_s
                _line(console, line)
        elif event.stage == "ready":
            console.print(f"{event.server} server healthy after {event.elapsed_s:.1f} s")
            last_print[0] = 0.0
        elif event.stage == "probe" and status:
            status.update(escape(f"{event.server}: {event.message}"))
        elif event.stage == "stopped" and status:
            status.stop()

    try:
        yield on_event
    finally:
        if status:
            status.stop()


def render_serve_check(console: Console, result: ServeCheckResult, notes: list[str]) -> None:
    """serve-check's table, its variants and tasks, then `notes` (the kvcalib logger's records), failures, verdict."""
    columns = ("prompt", "output (FP8 KV)", "baseline", "agreement")
    rows = (
        (
            escape(p.label or p.prompt),
            escape(repr(p.output)),
            "-" if p.baseline_output is None else escape(repr(p.baseline_output)),
            _num(p.agreement, ".2f") + _problem(p),
        )
        for p in result.prompts
    )
    title = f"serve-check {result.checkpoint} on {result.device}"
    _table(console, title, columns, rows, columns)
    fp8, base = result.runs["fp8"], result.runs.get("baseline")
    baseline = f", baseline {base.nll:.3f}" if base else ""
    agreement = "" if result.agreement is None else f", mean agreement {result.agreement:.2f}"
    baseline_ready = f" (baseline {base.ready_s:.1f} s)" if base else ""
    _line(
        console,
        f"ready in {fp8.ready_s:.1f} s{baseline_ready}; NLL fp8 {fp8.nll:.3f}{baseline}{agreement}; "
        f"log {fp8.log}",
    )
    if result.kv_capacity:  # as vLLM logged it (serving.server.kv_capacity)
        logged = (
            f"{name} not logged"
            if c.tokens is None
            else f"{name} {c.tokens:,} tokens ({_num(c.max_concurrency, '.2f')}x --max-model-len requests)"
            for name, c in result.kv_capacity.items()
        )
        _line(console, "KV cache vLLM logged: " + "; ".join(logged))
    if result.canary is not None or result.prediction is not None:
        render_variants(console, result)
    if result.tasks:
        render_served_tasks(console, result.tasks)
    for note in notes:
        console.print(f"[yellow]warning:[/] {escape(note)}", soft_wrap=True)
    for failure in result.failures:
        console.print(f"[red]failed:[/] {escape(failure)}", soft_wrap=True)
    console.print("[bold green]PASSED[/]" if result.ok else "[bold red]FAILED[/]")


def _problem(p: PromptResult) -> str:
    if p.problem is None:
        return ""
    if not p.failed:
        return f" [yellow]{escape(p.problem)}, as the baseline's[/]"
    return f" [red]{escape(p.problem)}[/]"


def render_served_tasks(console: Console, rows: tuple[ServedTaskRow, ...]) -> None:
    """serve-check --tasks: served baseline and FP8 scores with the paired interval, and kvcalib's prediction."""
    _table(
        console,
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
        (
            (
                row.task,
                f"{row.metric} ({row.filter})",
                str(row.items),
                *(
                    cell
                    for s in (row.served, row.predicted)
                    for cell in (
                        (f"{s.baseline:.4f}", f"{s.fp8:.4f}", _spread(s.interval))
                        if s
                        else ("-",) * 3
                    )
                ),
            )
            for row in rows
        ),
        ("task", "metric"),
    )
    for row in rows:
        _line(console, f"{row.task} {row.metric}: served {row.served.verdict}")


def render_variants(console: Console, result: ServeCheckResult) -> None:
    """Calibrated vs 1.0 vs the canary: what each server measured, and what kvcalib predicted; the calibrated scales'
    ΔNLL on the probe text, served and predicted, with their 95 % intervals; the canary's verdict."""
    _table(
        console,
        "KV scales served: NLL of the probe text, agreement with the baseline, ΔNLL vs the baseline",
        ("scales", "NLL", "agreement", "served ΔNLL", "predicted ΔNLL"),
        (
            (
                row["name"],
                _num(row["nll"], ".4f"),
                _num(row["agreement"], ".2f"),
                _num(row["served_delta_nll"], "+.4f"),
                _num(row["predicted_delta_nll"], "+.4f"),
            )
            for row in result.variants()
        ),
        ("scales",),
    )
    shown = {name: i for name, i in vars(result.intervals).items() if i is not None}
    words = {
        "served": "served ΔNLL",
        "predicted": "predicted ΔNLL",
        "served_minus_predicted": "served - predicted",
    }
    if shown:
        parts = (f"{words[name]} {_spread(i)} ({i.items} blocks)" for name, i in shown.items())
        _line(
            console,
            f"calibrated scales, approximate 95% intervals ({next(iter(shown.values())).method}): "
            + "; ".join(parts),
        )
    if result.canary is not None:
        color = "green" if result.canary.ok else "red"
        console.print(
            f"canary: [{color}]{'ok' if result.canary.ok else 'FAILED'}[/] {escape(result.canary.reason)}",
            soft_wrap=True,
        )
