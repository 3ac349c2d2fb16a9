"""What `kvcalib validate` returns: findings and the report that holds them (apart, so rule modules can import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ERROR", "Finding", "INFO", "SEVERITIES", "ValidationReport", "WARNING", "short_repr"]

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() of a value read from a file, cut to `limit` characters, for messages."""
    try:
        text = repr(value)
    except RecursionError:
        return "<a deeply nested value>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Finding:
    """One thing validation found: rule (a stable id), severity (error, warning, info), message, hint, location (a file,
    a key, or "config.json:quantization_config...")."""

    rule: str
    severity: str
    message: str
    hint: str | None = None
    location: str | None = None


@dataclass(frozen=True)
class ValidationReport:
    """Every finding for one checkpoint and target; to_json() is `validate --json`: checkpoint, target, ok (no errors;
    with --strict, no warnings either), findings (Finding)."""

    checkpoint: str
    target: str
    findings: tuple[Finding, ...]
    strict: bool = False

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == WARNING)

    @property
    def ok(self) -> bool:
        return not self.errors and not (self.strict and self.warnings)

    JSON = {"strict": None, "ok": "ok"}
