"""The commands' flags, built from the options dataclasses that declare them (kvcalib.core.options): name, type,
default, choices, help and panel are read from the field, so a flag is written once, in the library. One name per flag
is shown in --help: an alias (click's token_normalize_func maps it to the flag) and the other half of an on/off pair
are accepted, not listed (the help names it)."""

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


def _flag(field: dataclasses.Field) -> tuple[list[inspect.Parameter], tuple[bool, Any] | None]:
    """The flag of options field `field`: shown with the field's type (its choices as a Literal, a tuple repeatable),
    default and help; of an on/off pair, the half that changes the default shown, the other a hidden `NAME__off`, and
    (the value the shown half sets, the field's default)."""
    meta, name = field.metadata, field.name
    factory = field.default_factory is not dataclasses.MISSING
    default = field.default_factory() if factory else field.default
    shown, kind, help = flag_of(field), field.type, meta["help"]
    params, switch = [], None
    if "/" in shown:
        on, off = shown.split("/")
        shown, other, value = (off, on, False) if default is True else (on, off, True)
        hidden = typer.Option(other, hidden=True)
        params.append(
            inspect.Parameter(
                f"{name}__off", _KW, default=False, annotation=Annotated[bool, hidden]
            )
        )
        help, switch, kind, default = (
            f"{help} The opposite: {other}.",
            (value, default),
            bool,
            False,
        )
    elif (choices := choices_of(field)) is not None:
        kind = Literal[choices] | None if type(None) in typing.get_args(kind) else Literal[choices]
    elif typing.get_origin(kind) is tuple:
        kind, default = list[typing.get_args(kind)[0]], list(default)  # repeatable
    option = typer.Option(
        shown,
        *filter(None, [meta["short"]]),
        help=help,
        rich_help_panel=meta["panel"],
        metavar=meta["metavar"],
        show_default=not factory and kind is not bool and default is not None,
    )
    default = ... if default is dataclasses.MISSING else default
    return [
        inspect.Parameter(name, _KW, default=default, annotation=Annotated[kind, option]),
        *params,
    ], switch


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
    # click hands token_normalize_func a flag without its dashes
    aliases = {a[2:]: flag_of(f)[2:] for f in fields.values() for a in f.metadata["aliases"]}

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(func, include_extras=True)
        own = [
            p.replace(annotation=hints[p.name])
            for p in inspect.signature(func).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]

        @functools.wraps(func)
        def run(**parsed: Any) -> Any:
            for field_name, (_, switch) in flags.items():
                value = parsed[field_name]
                if switch is not None:
                    value = (
                        not switch[0]
                        if parsed.pop(f"{field_name}__off")
                        else switch[0]
                        if value
                        else switch[1]
                    )
                parsed[field_name] = tuple(value) if isinstance(value, list) else value
            return func(**parsed)

        run.__signature__ = inspect.Signature(
            [*own, *(p for params, _ in flags.values() for p in params)]
        )
        settings = {"token_normalize_func": lambda opt: aliases.get(opt, opt)}
        return app.command(name, context_settings=settings)(run)

    return register


def split_options(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}
