"""Progress: what calibrate and eval tell their caller while they work (the CLI draws it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Progress", "ProgressCallback", "no_progress"]


@dataclass(frozen=True)
class Progress:
    """One step of a long run: its stage, and how far it is."""

    stage: str  # "load-data" | "load-model" | "observe" | "objective" | "write"
    samples_done: int = 0
    samples_total: int = 0
    tokens_done: int = 0
    tokens_total: int = 0
    layer: int = 0  # the stream engine: the layer being observed, of num_layers
    num_layers: int = 0


ProgressCallback = Callable[[Progress], None]


def no_progress(_progress: Progress) -> None:
    """The callback of a caller that does not listen."""
