"""The commands' flags, built from the options dataclasses that declare them (kvcalib.core.options): name, type,
default, choices, help and panel are read from the field, so a flag is written once, in the library. One name per flag
is shown in --help: an alias and the other half of an on/off pair are accepted, not listed (the help names it)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer

from kvcalib.core.options import choices_of, flag_of

__all__ = ["command", "split_options"]

_KW = inspect.Parameter.KEYWORD_ONLY
# One field's flag: its parameters (the one --help shows, then the hidden ones) and how the field's value is read
# back from the values typer parsed.
Flag = tuple[list[inspect.Parameter], Callable[[dict[str, Any]], Any]]


def _flag(field: dataclasses.Field) -> Flag:
    """The flag of options field `field`: shown with the field's type (its choices as a Literal, a tuple repeatable),
    default and help; each alias a hidden flag that sets the field; of an on/off pair, the half that changes the
    default shown and the other hidden."""
    meta, name = field.metadata, field.name
    default = (
        field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    )
    shown, kind, help = flag_of(field), field.type, meta["help"]
    hidden: list[tuple[str, Any]] = [
        (a, None) for a in meta["aliases"]
    ]  # (flag, value: None = its own)
    switch = None  # an on/off pair: (the value the shown half sets, the field's default)
    if "/" in shown:
        on, off = shown.split("/")
        shown, other, value = (off, on, False) if default is True else (on, off, True)
        hidden.append((other, not value))
        help, switch, kind, default = (
            f"{help} The opposite: {other}.",
            (value, default),
            bool,
            False,
        )
    elif (choices := choices_of(field)) is not None:
        optional = type(None) in typing.get_args(kind)
        kind = Literal[choices] | None if optional else Literal[choices]
    elif typing.get_origin(kind) is tuple:
        kind, default = list[typing.get_args(kind)[0]], list(default)  # repeatable
    decls = (shown, *([meta["short"]] if meta["short"] else []))
    show_default = field.default_factory is dataclasses.MISSING and kind is not bool
    params = [
        inspect.Parameter(
            name,
            _KW,
            default=... if default is dataclasses.MISSING else default,
            annotation=Annotated[
                kind,
                typer.Option(
                    *decls,
                    help=help,
                    rich_help_panel=meta["panel"],
                    metavar=meta["metavar"],
                    show_default=show_default and default is not None,
                ),
            ],
        )
    ]
    for i, (decl, value) in enumerate(hidden):
        params.append(
            inspect.Parameter(
                f"{name}__{i}",
                _KW,
                default=None if value is None else False,
                annotation=Annotated[
                    kind if value is None else bool, typer.Option(decl, hidden=True)
                ],
            )
        )

    def read(parsed: dict[str, Any]) -> Any:
        value = parsed[name]
        if switch is not None:
            value = switch[0] if value else switch[1]
        for i, (_, sets) in enumerate(hidden):
            given = parsed[f"{name}__{i}"]
            if given not in (None, False, []):
                value = given if sets is None else sets
        return tuple(value) if isinstance(value, list) else value

    return params, read


def command(
    app: typer.Typer, name: str, *sources: type | tuple[type, tuple[str, ...]]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the function as command `name`: its own parameters (arguments and the command's own flags), then
    a flag for each option field of `sources`, options classes (every field) or (class, field names). A name an
    earlier source has is the same flag (eval's --device, both EvalOptions' and TaskOptions'). The fields reach the
    function as keywords, in its **values: an alias given as the field, an on/off pair as the field's value."""
    fields: dict[str, dataclasses.Field] = {}
    for source in sources:
        cls, names = source if isinstance(source, tuple) else (source, None)
        for field in dataclasses.fields(cls):
            if "help" in field.metadata and (names is None or field.name in names):
                fields.setdefault(field.name, field)
    flags = {field_name: _flag(field) for field_name, field in fields.items()}

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(func, include_extras=True)
        own = [
            p.replace(annotation=hints[p.name])
            for p in inspect.signature(func).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]

        @functools.wraps(func)
        def run(**parsed: Any) -> Any:
            values = {field_name: read(parsed) for field_name, (_, read) in flags.items()}
            return func(**{p.name: parsed[p.name] for p in own}, **values)

        params = [p for field_params, _ in flags.values() for p in field_params]
        run.__signature__ = inspect.Signature([*own, *params])  # type: ignore[attr-defined]
        return app.command(name)(run)

    return register


def split_options(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}
