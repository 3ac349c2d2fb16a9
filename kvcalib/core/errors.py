"""The exception family: one subclass per failure a user can cause; the message says what failed and where, `hint`
what to do next. The CLI catches `KvcalibError` only; anything else is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "DatasetError",
    "DeviceError",
    "KvcalibError",
    "MissingDependencyError",
    "OutOfMemoryError",
    "OutputExistsError",
    "OutputWriteError",
    "RecipeError",
    "ServerError",
    "UnknownTargetError",
    "UnsupportedModelError",
    "UsageError",
    "ValidationFailedError",
    "VllmNotFoundError",
    "check_at_least",
]


class KvcalibError(Exception):
    """Base class of every user-facing kvcalib error."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint

    def __str__(self) -> str:
        return self.message


class UsageError(KvcalibError):
    """Arguments that cannot work together, or an unknown value."""

    exit_code = 2


class UnknownTargetError(UsageError):
    """A target chip name kvcalib does not know."""


class CheckpointNotFoundError(KvcalibError):
    """The model/checkpoint directory (or its config.json) is missing."""

    exit_code = 2


class CheckpointReadError(KvcalibError):
    """A checkpoint file exists but cannot be parsed (config, index, safetensors header)."""

    exit_code = 2


class UnsupportedModelError(KvcalibError):
    """The checkpoint is not a causal LM whose attention kvcalib can observe."""


class DatasetError(KvcalibError):
    """The calibration dataset cannot be read, is empty, or lacks the text column."""


class CalibrationError(KvcalibError):
    """Calibration ran but its statistics cannot make valid scales (unobserved layer, inf)."""


class OutputExistsError(KvcalibError):
    """The output path exists and --overwrite was not given, or it would clobber an input."""

    exit_code = 2


class OutputWriteError(KvcalibError):
    """The output cannot be written: read-only, permission denied, disk full (nothing at OUT changed)."""


class ValidationFailedError(KvcalibError):
    """A checkpoint kvcalib wrote (or was asked to use) fails validation."""


class OutOfMemoryError(KvcalibError):
    """The model (or its activations) did not fit in host or device memory."""


class RecipeError(UsageError):
    """An llm-compressor recipe kvcalib cannot read, or a kv_cache_scheme the target cannot serve."""


class MissingDependencyError(KvcalibError):
    """An optional dependency (an extra such as kvcalib[llmcompressor]) is not installed, or a dependency's release
    lacks what kvcalib uses (transformers' internals: kvcalib.hf.internals)."""


# serve-check: exit codes 3 (the environment cannot run the check) and 4 (the server failed).
class DeviceError(KvcalibError):
    """The requested device is not usable here: no Neuron devices, wrong chip, CPU lacks AVX-512."""

    exit_code = 3


class VllmNotFoundError(KvcalibError):
    """The interpreter given for vLLM does not exist or has no vLLM (or no Neuron plugin)."""

    exit_code = 3


class ServerError(KvcalibError):
    """The vLLM server exited, never became healthy, or stopped answering; `log` is its log file."""

    exit_code = 4

    def __init__(self, message: str, hint: str | None = None, log: str | None = None) -> None:
        super().__init__(
            message,
            hint
            or (
                f"the server's log is {log}"
                if log
                else "rerun with --log-dir DIR to keep the server's log"
            ),
        )
        self.log = log


def check_at_least(flag: str, value: float | None, minimum: float, *, what: str = "") -> None:
    """UsageError naming `flag` unless `value` (None: not given) is at least `minimum`."""
    if value is not None and not value >= minimum:
        raise UsageError(
            f"{flag} must be at least {minimum:g}, not {value:g}" + (f" ({what})" if what else ""),
            hint=f"pass {flag} {minimum:g} or more, or leave it out for the default",
        )
