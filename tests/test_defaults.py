"""Each option and its default are declared once, in an options class: the API's keywords and the CLI's flags read
that declaration, so `kvcalib.calibrate(...)` and `kvcalib calibrate ...` cannot disagree on a default, and every
option with a fixed set of values lists it in --help."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pydoc
import typing

import pytest
import typer
from typer.testing import CliRunner

import kvcalib
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.cli import LONG, app
from kvcalib.core.options import choices_of, flag_of
from kvcalib.evaluation.needle import DEFAULT_KEYS, DEPTHS
from kvcalib.evaluation.options import EvalOptions, TaskOptions
from kvcalib.serving.options import ServeOptions

# command -> (options class, the fields of it that are the command's flags (None: all), the API functions taking
# every field of the class as a keyword)
COMMANDS = {
    "calibrate": [
        (CalibrateOptions, None, (kvcalib.calibrate, kvcalib.plan)),
        (
            ServeOptions,
            None,
            (kvcalib.serve_check,),
        ),  # --serve-check's; its --device is --serve-check
    ],
    "eval": [(EvalOptions, None, (kvcalib.evaluate,))],
    "eval-context": [(EvalOptions, LONG, (kvcalib.evaluate_context,))],
    "eval-needle": [(EvalOptions, (*LONG, "seed", "order"), (kvcalib.evaluate_needle,))],
    "eval-tasks": [(TaskOptions, None, (kvcalib.evaluate_tasks,))],
    "serve-check": [
        (ServeOptions, None, (kvcalib.serve_check,)),
        (TaskOptions, ("limit", "task_data"), (kvcalib.evaluate_tasks,)),
    ],
}
# The keywords of the public functions that are no options field.
NOT_FIELDS = {"options", "progress", "serve_check", "serve", "serve_progress", "nll", "keys"}


def click_command(name: str):
    return typer.main.get_command(app).commands[name]


def help_text(name: str) -> str:
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def api_default(field: dataclasses.Field):
    """What the API's keyword defaults to for `field`: its default; None where the class builds it; none when
    the field is required."""
    if field.default_factory is not dataclasses.MISSING:
        return None
    return inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default


def cli_default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


CLASSES = list(
    dict.fromkeys((cls, f) for entries in COMMANDS.values() for cls, _, fs in entries for f in fs)
)


@pytest.mark.parametrize(
    ("cls", "func"), list(CLASSES), ids=[f"{c.__name__}-{f.__name__}" for c, f in CLASSES]
)
def test_the_api_takes_every_field_with_its_default(cls, func):
    params = inspect.signature(func).parameters
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, field in fields.items():
        if name == "tasks" and cls is TaskOptions:
            assert params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            continue
        assert name in params, f"{func.__name__} has no keyword {name}"
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == api_default(field), name
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - set(fields) <= NOT_FIELDS


def test_help_shows_the_keywords():
    """help(kvcalib.calibrate) shows each keyword and its default (a real signature, not **options)."""
    text = pydoc.render_doc(kvcalib.calibrate, renderer=pydoc.plaintext)
    assert "num_samples: 'int' = 32" in text and "engine: 'Engine' = 'auto'" in text
    assert "**" not in text.split("\n")[2]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_defaults_to_the_api_default(command):
    owner: dict[str, tuple[dataclasses.Field, tuple]] = {}
    for cls, names, funcs in COMMANDS[command]:
        for field in dataclasses.fields(cls):
            if "help" in field.metadata and (names is None or field.name in names):
                owner.setdefault(field.name, (field, funcs))
    shown = {p.name: p for p in click_command(command).params if not p.hidden}
    assert set(owner) <= set(shown), set(owner) - set(shown)
    for name, (field, funcs) in owner.items():
        param = shown[name]
        for func in funcs:
            assert inspect.signature(func).parameters[name].default == api_default(field), name
        if "/" in flag_of(
            field
        ):  # an on/off pair: unset is the field's default, the shown half changes it
            on, off = flag_of(field).split("/")
            assert param.default is False and param.opts == [off if field.default is True else on]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            assert param.required, name
        elif param.multiple:
            assert tuple(param.default) == cli_default(field), name
        else:
            assert param.default == cli_default(field), name


def test_validate_defaults_to_the_api_default():
    params = inspect.signature(kvcalib.validate).parameters
    for param in click_command("validate").params:
        if param.name in params:
            assert param.default == params[param.name].default, param.name


def literal_choices(annotation) -> tuple | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


@pytest.mark.parametrize("command", ["calibrate", "validate", "eval", "serve-check"])
def test_every_choice_is_listed_in_help(command):
    """Each option with a fixed set of values, a field's or the command's own (--serve-check, validate's
    --target), is a Literal whose values --help lists."""
    fields: dict[str, dataclasses.Field] = {}
    for cls, _, _ in COMMANDS.get(command, []):  # a name the first class has is its flag
        for field in dataclasses.fields(cls):
            fields.setdefault(field.name, field)
    text, listed = help_text(command), 0
    for param in click_command(command).params:
        if param.hidden:
            continue
        choices = literal_choices(param.type_descriptor.annotation)
        field = fields.get(param.name)
        if field is not None and "/" not in flag_of(field):
            assert choices == choices_of(field), param.name
        if choices is not None:
            assert "|".join(choices) in text, param.name
            listed += 1
    assert listed >= {"calibrate": 8, "validate": 1, "eval": 5, "serve-check": 1}[command]


def test_needle_without_keys_takes_its_own_default(calibrated, text_dataset):
    """eval-needle without --keys places DEFAULT_KEYS keys per depth."""
    result = CliRunner().invoke(
        app,
        ["eval-needle", str(calibrated), "-d", str(text_dataset), "--lengths", "300"]
        + ["--dtype", "float32", "--json"],
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["trials"]) == DEFAULT_KEYS * len(DEPTHS)


def test_the_token_budget_says_why_a_run_has_its_tokens():
    """The result, the card and --plan carry CalibrateOptions.token_budget: the defaults name what they rest on
    (the token study), other sizes the flags; a dataset short of rows or of tokens per row is said."""
    from kvcalib.calibration.options import TOKEN_STUDY
    from kvcalib.hf.data import CalibrationData

    def data(rows: int, length: int) -> CalibrationData:
        return CalibrationData(((1,) * length,) * rows, "d.jsonl", "train", "text", rows, 0)

    defaults = CalibrateOptions()
    full = data(defaults.num_samples, defaults.max_seq_len)
    assert defaults.token_budget(full) == (
        f"the defaults, --num-samples {defaults.num_samples} x --max-seq-len {defaults.max_seq_len}: "
        + TOKEN_STUDY
    )
    small = CalibrateOptions(num_samples=16, max_seq_len=256)
    assert small.token_budget(data(16, 256)) == "--num-samples 16 x --max-seq-len 256"
    assert small.token_budget(data(5, 100)) == (
        "asked --num-samples 16 x --max-seq-len 256; the dataset gave 5 rows; rows average 100 tokens"
    )
    empty = dataclasses.replace(data(12, 256), rows_selected=16, rows_empty=4)
    assert small.token_budget(empty) == "asked --num-samples 16 x --max-seq-len 256; 4 rows empty"
