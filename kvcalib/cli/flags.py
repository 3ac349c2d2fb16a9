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

from kvcalib.core.options import annotation_of, choices_of, flag_of

__all__ = ["command", "flags", "split_options"]

_KW = inspect.Parameter.KEYWORD_ONLY
# hidden parameter -> (the field it sets, the value it sets it to: None for the alias' own value)
_HIDDEN: dict[str, tuple[str, Any]] = {}
_SWITCHES: dict[
    str, tuple[bool, Any]
] = {}  # a shown on/off flag -> (the value it sets, the field's default)


def flags(cls: type, *names: str, **defaults: Any) -> list[inspect.Parameter]:
    """Typer parameters for the fields `names` of options class `cls` (every flag-declared field when none are
    named); `defaults`: the command's own default for a field, where it differs from the library's."""
    by_name, params = {f.name: f for f in dataclasses.fields(cls)}, []
    for name in names or tuple(n for n, f in by_name.items() if f.metadata.get("cli")):
        field, kind = by_name[name], annotation_of(cls, name)
        meta = field.metadata
        default = defaults.get(
            name,
            field.default_factory()
            if field.default_factory is not dataclasses.MISSING
            else field.default,
        )
        shown, hidden, help = (
            flag_of(field),
            [(alias, None) for alias in meta["aliases"]],
            meta["help"],
        )
        if "/" in shown:  # an on/off pair: the half that changes the default is shown
            on, off = shown.split("/")
            shown, other, value = (off, on, False) if default is True else (on, off, True)
            hidden.append((other, not value))
            help = f"{help} The opposite: {other}."
            _SWITCHES[name] = (value, default)
            kind, default = bool, False
        else:
            choices = choices_of(cls, field)
            if choices is not None:
                kind = (
                    Literal[choices] | None
                    if type(None) in typing.get_args(kind)
                    else Literal[choices]
                )
            elif typing.get_origin(kind) is tuple:
                kind, default = list[typing.get_args(kind)[0]], list(default)  # repeatable
        shown_default = (
            field.default_factory is dataclasses.MISSING
            and default is not None
            and kind is not bool
        )
        decls = (shown, *([meta["short"]] if meta["short"] else []))
        params.append(
            inspect.Parameter(
                name,
                _KW,
                default=default,
                annotation=Annotated[
                    kind,
                    typer.Option(
                        *decls,
                        help=help,
                        rich_help_panel=meta["panel"],
                        metavar=meta["metavar"],
                        show_default=shown_default,
                    ),
                ],
            )
        )
        for i, (decl, value) in enumerate(hidden):
            _HIDDEN[f"{name}__{i}"] = (name, value)
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
    return params


def _merged(values: dict[str, Any]) -> dict[str, Any]:
    """The fields' values from flags()' parameters: an alias given overrides; an on/off pair resolves."""
    out = {k: v for k, v in values.items() if k not in _HIDDEN}
    for name, (value, default) in _SWITCHES.items():
        if name in out:
            out[name] = value if out[name] else default
    for key, (name, value) in _HIDDEN.items():
        given = values.get(key)
        if key in values and given not in (None, False, []):
            out[name] = given if value is None else value
    return out


def command(
    app: typer.Typer, name: str | None = None, *, options: list[inspect.Parameter]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the function as command `name` with its own parameters (arguments and the command's own flags)
    followed by `options` (flags()); they all reach it as keywords, the options in its **kwargs."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(func, include_extras=True)
        own = [
            p.replace(annotation=hints[p.name])
            for p in inspect.signature(func).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]

        @functools.wraps(func)
        def run(**values: Any) -> Any:
            return func(**_merged(values))

        run.__signature__ = inspect.Signature([*own, *options])  # type: ignore[attr-defined]
        return app.command(name)(run)

    return register


def split_options(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that are fields of `cls`, repeatable flags' lists as the tuples the field holds."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
