"""The command line's contract, pinned: flags (--help), --json shapes and output files on the tiny model.

The golden files under tests/golden/ were written from the CLI as it is; a change to a flag, a
JSON key or an output file shows here. Values that depend on the machine are compared as
what they are: paths with the test's own directories replaced, floats to 1e-3 (relative or
absolute: float32 rounding differs between CPUs, and ΔNLL is a difference of near-equal
numbers), timings only by type. To rewrite the golden files
after an intended change: KVCALIB_UPDATE_GOLDEN=1 pytest tests/e2e/test_golden.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import REPO
from typer.testing import CliRunner

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("KVCALIB_UPDATE_GOLDEN") == "1"
VOLATILE = {
    "seconds",
    "tokens_per_s",
    "ready_s",
    "objective_seconds",  # timings: compared by type only
    "version",  # the installed compressed-tensors and transformers releases, in config.json (CI's two legs
    "transformers_version",  # differ)
    "significant",
}  # whether an interval of near-zero differences excludes 0: CPU rounding decides
HELP_ENV = {"COLUMNS": "120", "TERMINAL_WIDTH": "120", "NO_COLOR": "1", "FORCE_COLOR": None}


def normalise(obj, roots: dict[str, str]):
    if isinstance(obj, dict):
        return {k: normalise(v, roots) for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalise(v, roots) for v in obj]
    if isinstance(obj, str):
        for root, name in roots.items():
            obj = obj.replace(root, name)
        return obj
    return obj


def assert_matches(actual, expected, where: str = "$") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert sorted(actual) == sorted(expected), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            if key in VOLATILE:
                assert type(actual[key]) is type(expected[key]) or {
                    type(actual[key]),
                    type(expected[key]),
                } <= {int, float}, f"{where}.{key}"
            else:
                assert_matches(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (
            f"{where}: {actual!r} != {expected!r}"
        )
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_matches(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(expected, bool):
        assert isinstance(actual, (int, float)), f"{where}: {actual!r}"
        if math.isfinite(expected):
            assert actual == pytest.approx(expected, rel=1e-3, abs=1e-3), (
                f"{where}: {actual} != {expected}"
            )
        else:
            assert actual == expected, where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def check_golden(name: str, actual) -> None:
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        if isinstance(actual, str):
            path.write_text(actual)
        else:
            path.write_text(json.dumps(actual, indent=2, sort_keys=True) + "\n")
        return
    if isinstance(actual, str):
        assert actual == path.read_text(), f"{name} changed"
    else:
        assert_matches(actual, json.loads(path.read_text()), name)


@pytest.fixture(scope="module")
def golden_run(tiny_llama_master, text_dataset, tmp_path_factory):
    from kvcalib.cli import app

    root = tmp_path_factory.mktemp("golden")
    out = root / "out"
    runner = CliRunner()
    roots = {
        str(out): "<OUT>",
        str(tiny_llama_master): "<MODEL>",
        str(text_dataset): "<DATA>",
        str(REPO): "<REPO>",
    }
    calibrated = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(out),
            "--num-samples",
            "8",
            "--max-seq-len",
            "64",
            "--json",
        ],
    )
    assert calibrated.exit_code == 0, calibrated.stderr
    validated = runner.invoke(app, ["validate", str(out), "--json"])
    evaluated = runner.invoke(
        app,
        [
            "eval",
            str(out),
            "--dataset",
            str(text_dataset),
            "--num-samples",
            "4",
            "--max-seq-len",
            "64",
            "--compare",
            "unit",
            "--json",
        ],
    )
    assert validated.exit_code == 0 and evaluated.exit_code == 0, (
        validated.stderr + evaluated.stderr
    )
    return out, roots, {"calibrate": calibrated, "validate": validated, "eval": evaluated}


@pytest.mark.parametrize("command", ["calibrate", "validate", "eval"])
def test_json_output_is_unchanged(golden_run, command):
    _, roots, results = golden_run
    check_golden(f"{command}.json", normalise(json.loads(results[command].stdout), roots))


def test_output_files_are_unchanged(golden_run):
    from safetensors import safe_open

    out, roots, _ = golden_run
    listing = sorted(p.name for p in out.iterdir())
    files = {"listing": listing}
    for name in ("config.json", "model.safetensors.index.json", "kvcalib_calibration.json"):
        files[name] = normalise(json.loads((out / name).read_text()), roots)
    with safe_open(str(out / "kv_scales.safetensors"), "pt") as f:
        metadata = f.metadata()
        files["kv_scales.safetensors"] = {
            "keys": sorted(f.keys()),
            "shapes": {k: list(f.get_slice(k).get_shape()) for k in f.keys()},
            "dtypes": sorted({f.get_slice(k).get_dtype() for k in f.keys()}),
            "metadata": {
                "format": metadata["format"],
                "kvcalib": normalise(json.loads(metadata["kvcalib"]), roots),
            },
        }
    check_golden("output-files.json", files)


@pytest.mark.parametrize(
    "command",
    [
        None,
        "calibrate",
        "validate",
        "eval",
        "eval-context",
        "eval-needle",
        "eval-tasks",
        "serve-check",
    ],
)
def test_flags_are_unchanged(command, monkeypatch):
    from kvcalib.cli import app

    for key, value in HELP_ENV.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    # typer reads TERMINAL_WIDTH once, when typer.rich_utils is imported: whichever test of this process came first
    monkeypatch.setattr("typer.rich_utils.MAX_WIDTH", int(HELP_ENV["TERMINAL_WIDTH"]))
    args = ([command] if command else []) + ["--help"]
    result = CliRunner().invoke(app, args, env={k: v for k, v in HELP_ENV.items() if v is not None})
    assert result.exit_code == 0
    check_golden(f"help-{command or 'root'}.txt", help_text(result.stdout))


def help_text(text: str) -> str:
    """--help with this interpreter's path (serve-check's --vllm-python default) and the padding it moves taken out."""
    text = text.replace(sys.executable, "<PYTHON>")
    return "\n".join(re.sub(r" {2,}", " ", line).rstrip() for line in text.splitlines()) + "\n"
