"""What every command shares: the stderr console, the error boundary (KvcalibError and the terminating
signals), the library's notes, JSON on stdout."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from kvcalib.core.errors import KvcalibError
from kvcalib.core.records import to_json

__all__ = ["Interrupted", "_errors", "_print_json", "_stderr", "captured_notes"]


def _stderr(quiet: bool = False) -> Console:
    return Console(stderr=True, highlight=False, quiet=quiet)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C would raise KeyboardInterrupt, so every command cleans up alike."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _errors(quiet: bool = False, interrupted: str = "nothing partial was left") -> Iterator[None]:
    """The error boundary: a KvcalibError is one message (exit code by class); SIGINT, SIGTERM (a CI timeout,
    `kill`) and SIGHUP (a closed terminal) unwind the command like Ctrl-C and exit 128 + the signal's number."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        pass
    console = _stderr(quiet)
    try:
        yield
    except KvcalibError as err:
        # quiet: a torchrun rank other than 0; rank 0 reports (with this rank's message). Escaped: a hint such as
        # `pip install kvcalib[llmcompressor]` is no markup.
        console.print(f"[bold red]error:[/] {escape(err.message)}", soft_wrap=True)
        if err.hint:
            console.print(f"[yellow]hint:[/] {escape(err.hint)}", soft_wrap=True)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        console.print(
            f"[bold red]interrupted[/] ({signal.Signals(signum).name}): {escape(interrupted)}"
        )
        raise typer.Exit(128 + signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def captured_notes() -> Iterator[list[str]]:
    """The `kvcalib` logger's records while a job runs (a result's notes), kept for the renderer to print after the
    table, not through a progress bar; meanwhile they do not reach the root logger's handlers (printed once)."""
    notes: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    logger, handler = logging.getLogger("kvcalib"), Collect(logging.WARNING)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield notes
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_json(obj), indent=2, sort_keys=True) + "\n")
