"""Each option is declared once, as a field of its options class: the API's keywords are those fields (checked, and
shown in help()), the CLI's flags are built from them (kvcalib.cli.flags). What still can go wrong is checked here:
a flag left out, an alias or an on/off pair, read back as the field; a keyword misspelt, or beside options=."""

from __future__ import annotations

import dataclasses
import json
import pydoc

import pytest
import typer
from typer.testing import CliRunner

import kvcalib
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.cli import app
from kvcalib.cli.flags import command
from kvcalib.core.errors import UsageError
from kvcalib.evaluation.needle import DEFAULT_KEYS, DEPTHS
from kvcalib.evaluation.options import EvalOptions, TaskOptions
from kvcalib.serving.options import ServeOptions


def parsed(cls: type, *args: str) -> dict:
    """The keywords a command built from `cls`'s fields gets for `args`."""
    cli, got = typer.Typer(), {}
    cli.callback()(lambda: None)

    @command(cli, "run", cls)
    def run(**values) -> None:
        got.update(values)

    result = CliRunner().invoke(cli, ["run", *args])
    assert result.exit_code == 0, result.output
    return got


@pytest.mark.parametrize(
    ("cls", "args", "given"),
    [
        (CalibrateOptions, (), {}),
        (EvalOptions, (), {}),
        (TaskOptions, (), {}),
        (ServeOptions, ("--device", "cpu"), {"device": "cpu"}),
        (
            CalibrateOptions,
            ("--num-calibration-samples", "5", "--dataset-split", "x", "--no-add-special-tokens"),
            {"num_samples": 5, "split": "x", "add_special_tokens": False},
        ),
        (EvalOptions, ("--compare", "unit", "--compare", "b"), {"compare": ("unit", "b")}),
        (
            ServeOptions,
            ("--device", "cpu", "--baseline", "--no-predict", "--no-canary"),
            {"device": "cpu", "baseline": True, "predict": False, "canary": False},
        ),
    ],
)
def test_flags_read_back_as_the_fields(cls, args, given):
    """No flag: every field's default; an alias or either half of an on/off pair sets the field."""
    assert cls(**parsed(cls, *args)) == cls(**given)


CALLS = {
    "calibrate": lambda **kw: kvcalib.calibrate("m", "d", "o", **kw),
    "plan": lambda **kw: kvcalib.plan("m", "d", "o", **kw),
    "evaluate": lambda **kw: kvcalib.evaluate("c", "d", **kw),
    "evaluate_context": lambda **kw: kvcalib.evaluate_context("c", "d", [64], **kw),
    "evaluate_needle": lambda **kw: kvcalib.evaluate_needle("c", "d", [64], **kw),
    "evaluate_tasks": lambda **kw: kvcalib.evaluate_tasks("c", ["t"], **kw),
    "serve_check": lambda **kw: kvcalib.serve_check("c", **kw),
}
OPTIONS = {"calibrate": CalibrateOptions(), "plan": CalibrateOptions()} | {
    name: EvalOptions() for name in ("evaluate", "evaluate_context", "evaluate_needle")
}
OPTIONS |= {"evaluate_tasks": TaskOptions(tasks=("t",)), "serve_check": ServeOptions("cpu")}


@pytest.mark.parametrize("name", list(CALLS))
def test_keywords_are_the_fields_and_not_beside_options(name):
    """A keyword no field names is Python's own TypeError (the machine's cpu, memory, ranks are none); keywords
    beside options= are refused, named, not dropped."""
    call = CALLS[name]
    for wrong in ("num_sample", "cpu", "memory", "ranks", "scratch_dir", "memory_bytes"):
        with pytest.raises(
            TypeError, match=rf"^{name}\(\) got an unexpected keyword argument '{wrong}'$"
        ):
            call(**{wrong: 1})
    with pytest.raises(
        UsageError, match=r"options= or keywords, not both: seed, target given"
    ) as err:
        call(options=OPTIONS[name], target="gpu", seed=1)
    assert err.value.message.startswith(f"{name}()")


def test_help_shows_the_keywords():
    """help(kvcalib.calibrate) shows each field as a keyword with its default, not **fields."""
    text = pydoc.render_doc(kvcalib.calibrate, renderer=pydoc.plaintext)
    assert "num_samples: int = 32" in text and "engine: Literal[" in text and "**" not in text
    assert "seed: int = 1234" in pydoc.render_doc(kvcalib.evaluate_tasks, renderer=pydoc.plaintext)


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


def test_a_string_for_a_tuple_keyword_is_one_entry():
    """compare="unit" is the scale set "unit", not its four letters."""
    from kvcalib.api import _options

    assert _options(EvalOptions, None, {"compare": "unit"}, "evaluate").compare == ("unit",)
    assert _options(EvalOptions, None, {"compare": ["unit", "b"]}, "evaluate").compare == (
        "unit",
        "b",
    )
