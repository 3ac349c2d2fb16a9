"""Options declared once: each field of a job's options dataclass holds its flag, help, panel, choices and lower
bound; the library checks values from that (`check_options`), the API takes each field as a keyword with the field's
default (kvcalib.api), the CLI builds its parameters from the same fields (kvcalib.cli.flags).

The options modules keep real annotations (no `from __future__ import annotations`), so a field's type is the type
object itself, `dataclasses.fields(cls)[i].type`, read without evaluating a string."""

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, Literal

from kvcalib.core.errors import UsageError, check_at_least

__all__ = [
    "PANELS",
    "Bf16Compute",
    "Device",
    "Dtype",
    "ModelOptions",
    "RunOptions",
    "check_options",
    "choices_of",
    "flag_of",
    "option",
]

# The help panels, in the order --help shows them.
PANELS = ("Data", "Scales", "Engine", "Output", "Serving")

# Each option with a fixed set of values is a Literal, declared once: the field, the API's keyword and --help use it.
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Device = Literal["cpu", "cuda"]
Bf16Compute = Literal["auto", "native", "float32"]


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    panel: str = "Data",
    flag: str | None = None,
    short: str | None = None,
    aliases: tuple[str, ...] = (),
    minimum: float | None = None,
    what: str = "",
    choices: Callable[[], tuple[str, ...]] | None = None,
    metavar: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also a flag (default --field-name); `minimum` is checked with `what` it counts,
    `choices` a callable for a table's (else a Literal annotation's). A field declared otherwise is the library's
    only (no flag)."""
    assert panel in PANELS, panel
    meta = {k: v for k, v in locals().items() if k not in ("default", "factory")}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def choices_of(field: dataclasses.Field) -> tuple[str, ...] | None:
    """The values `field` may take (its table's, else its Literal annotation's), or None for any."""
    if field.metadata.get("choices") is not None:
        return field.metadata["choices"]()
    for arg in (field.type, *typing.get_args(field.type)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


def check_options(options: Any) -> None:
    """Every declared bound and choice of `options`, a UsageError naming the flag for the first one broken."""
    for field in dataclasses.fields(options):
        value, meta = getattr(options, field.name), field.metadata
        if "help" not in meta or value is None:
            continue
        if meta["minimum"] is not None:
            check_at_least(flag_of(field), value, meta["minimum"], what=meta["what"])
        allowed = None if meta["choices"] else choices_of(field)  # a table's: its own error
        if allowed is not None and value not in allowed:
            raise UsageError(
                f"unknown {flag_of(field)} {value!r}", hint=f"use one of {', '.join(allowed)}"
            )


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model runs: what calibrate, eval and eval-tasks all take."""

    dtype: Dtype = option("auto", "Weights' dtype: auto is the checkpoint's.", panel="Engine")
    device: Device = option("cpu", "Where the model runs.", panel="Engine")
    trust_remote_code: bool = option(False, "Allow the model's own code.", panel="Engine")
    bf16_compute: Bf16Compute = option(
        "auto",
        "bf16 models on CPU: auto is float32 matmuls with bf16 rounding where the CPU has no native bf16 "
        "matmul (no avx512_bf16 or amx_bf16).",
        panel="Engine",
    )

    def check_arguments(self) -> None:
        """The values a user passes, checked before anything is read (UsageError naming the flag)."""
        check_options(self)


@dataclasses.dataclass(frozen=True)
class RunOptions(ModelOptions):
    """What calibrate and eval both take: the data split and column, the seed, how the model runs."""

    split: str = option("train", "Dataset split.", aliases=("--dataset-split",))
    text_column: str | None = option(
        None, "Column with the text (default: 'text', else chat 'messages')."
    )
    seed: int = option(42, "Shuffle seed (llm-compressor's default).")
    add_special_tokens: bool | None = option(
        None,
        "Add the tokenizer's special tokens (e.g. BOS) to every row / to none. Default: as vLLM serves it, "
        "plain text with them, chat-template text without.",
        flag="--add-special-tokens/--no-add-special-tokens",
    )
