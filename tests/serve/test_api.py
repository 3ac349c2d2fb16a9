"""The Python API does what the command line does: calibrate -> validate -> serve-check (the fake vLLM) through
`kvcalib.*` alone gives the CLI's JSON, figure for figure, and the same model card; notes go to logging."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from serve_helpers import assert_nothing_left
from typer.testing import CliRunner

import kvcalib
from kvcalib.cli import app
from kvcalib.core.records import to_json

TIMING = re.compile(
    r"seconds|_s$|tokens_per_s|^pid|server_pids|ready|^log|^baseline_log|checkpoint|output|path|"
    r"command|^url|^port|wall"
)


def comparable(obj, root: Path):
    """`obj` without timings, process ids, ports and the run's own paths (written as <out>)."""
    if isinstance(obj, dict):
        return {k: comparable(v, root) for k, v in obj.items() if not TIMING.search(k)}
    if isinstance(obj, list):
        return [comparable(v, root) for v in obj]
    if isinstance(obj, str):
        return obj.replace(str(root), "<out>")
    return obj


def cli_json(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr and result.stdout, result.stderr
    return result.exit_code, json.loads(result.stdout)


def test_the_api_gives_the_cli_results(head32_model, text_dataset, cpu_python, tmp_path, caplog):
    api_out, cli_out = tmp_path / "api" / "ckpt", tmp_path / "cli" / "ckpt"
    serve = {"vllm_python": cpu_python}
    with caplog.at_level(logging.WARNING, logger="kvcalib"):
        calibrated = kvcalib.calibrate(
            head32_model,
            str(text_dataset),
            api_out,
            target="gpu",
            num_samples=4,
            max_seq_len=32,
            serve_check="cpu",
            serve={**serve, "log_dir": tmp_path / "api" / "logs"},
        )
    report = kvcalib.validate(api_out, target="gpu")
    served = kvcalib.serve_check(
        api_out, device="cpu", log_dir=tmp_path / "api" / "logs2", stop_timeout_s=5.0, **serve
    )

    code, cli = cli_json(
        "calibrate",
        head32_model,
        "--dataset",
        text_dataset,
        "-o",
        cli_out,
        "--target",
        "gpu",
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
        "--serve-check",
        "cpu",
        "--vllm-python",
        cpu_python,
        "--log-dir",
        tmp_path / "cli" / "logs",
        "--json",
    )
    assert code == 0 and calibrated.serve_check.ok and report.ok and served.ok
    validated = cli_json("validate", cli_out, "--target", "gpu", "--json")
    checked = cli_json(
        "serve-check",
        cli_out,
        "--device",
        "cpu",
        "--vllm-python",
        cpu_python,
        "--stop-timeout",
        "5",
        "--log-dir",
        tmp_path / "cli" / "logs2",
        "--json",
    )

    # the same scales, computed the same way (the host CPU read alike), validated alike, served alike
    assert calibrated.compute == cli["calibration"]["compute"]

    def same(ours: dict, theirs: dict) -> bool:
        a, b = comparable(ours, api_out.parent), comparable(theirs, cli_out.parent)
        assert a == b, [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
        return True

    assert same(to_json(calibrated), cli["calibration"]) and same(
        to_json(calibrated.serve_check), cli["serve_check"]
    )
    assert validated[0] == 0 and same(to_json(report), validated[1])
    assert checked[0] == 0 and same(to_json(served), checked[1])
    # the model card: validate's and serve-check's figures, the same text but for the paths
    api_card = (api_out / "README.md").read_text().replace(str(api_out), "<out>")
    assert "### serve-check" in api_card
    assert api_card == (cli_out / "README.md").read_text().replace(str(cli_out), "<out>")
    # every note the results carry went to the kvcalib logger, once
    notes = [r.getMessage() for r in caplog.records if r.name.startswith("kvcalib")]
    assert notes == [*calibrated.warnings, *calibrated.serve_check.warnings, *served.warnings]
    assert_nothing_left(str(tmp_path), "")


def test_serve_checks_prediction_keeps_within_max_memory(
    head32_model, text_dataset, cpu_python, tmp_path
):
    """calibrate --serve-check's prediction is sized by the memory the run may use, --max-memory's cap included
    (not the host's free memory): a cap too small for the model in float32 skips it, saying so."""
    calibrated = kvcalib.calibrate(
        head32_model,
        str(text_dataset),
        tmp_path / "ckpt",
        target="gpu",
        num_samples=4,
        max_seq_len=32,
        max_memory=0,
        serve_check="cpu",
        serve={"vllm_python": cpu_python, "log_dir": tmp_path / "logs", "canary": False},
    )
    assert calibrated.serve_check.prediction is None
    assert any(
        w.startswith("no prediction: the model needs about")
        and "of the 0.0 GiB this run may use" in w
        for w in calibrated.serve_check.warnings
    ), calibrated.serve_check.warnings
    assert_nothing_left(str(tmp_path), "")
