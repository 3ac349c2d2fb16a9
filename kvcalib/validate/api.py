"""`kvcalib.validate(...)`: validate as the command line runs it (kvcalib/__init__.py lists the API)."""

from __future__ import annotations

from pathlib import Path

from kvcalib.core.fp8 import DEFAULT_TARGET
from kvcalib.validate.pipeline import validate_checkpoint
from kvcalib.validate.report import ValidationReport

__all__ = ["validate"]


def validate(path: str | Path, *, target: str = DEFAULT_TARGET, strict: bool = False) -> ValidationReport:
    """The Neuron platform's quantization-config rules and kvcalib's own checks on the checkpoint at `path`
    (`kvcalib validate`). Returns the ValidationReport: `.ok` (with `strict`, warnings count as errors),
    `.findings`, `.to_dict()` the command's --json. Loads no torch."""
    return validate_checkpoint(Path(path), target, strict=strict)
