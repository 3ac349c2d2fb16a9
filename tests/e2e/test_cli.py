"""The command line: exit codes, JSON on stdout, humans on stderr, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from kvcalib.cli import app

runner = CliRunner()


def test_calibrate_json_on_stdout_and_table_on_stderr(tiny_llama_master, text_dataset, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
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
            "--target",
            "trn3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert {"output", "target", "fp8_max", "num_samples", "num_tokens", "layers"} <= set(payload)
    assert (
        payload["target"] == "trn3" and payload["fp8_max"] == 448.0 and payload["num_samples"] == 8
    )
    assert [layer["layer"] for layer in payload["layers"]] == [0, 1, 2]
    assert set(payload["layers"][0]) == {"layer", "k", "v"}
    assert set(payload["layers"][0]["k"]) >= {"absmax", "scale", "key", "range", "choice"}
    assert "KV scales for trn3" in result.stderr and f"wrote {out}" in result.stderr
    assert (out / "config.json").exists()


def test_llm_compressor_argument_names(tiny_llama_master, text_dataset, tmp_path):
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "out"),
            "--num-calibration-samples",
            "3",
            "--max-seq-length",
            "16",
            "--dataset-split",
            "train",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["num_samples"] == 3 and payload["num_tokens"] <= 48


def test_calibrate_user_errors_are_one_line_and_a_hint(tiny_llama_master, text_dataset, tmp_path):
    cases = [
        (
            [
                "calibrate",
                str(tmp_path / "nope"),
                "--dataset",
                str(text_dataset),
                "-o",
                str(tmp_path / "o"),
            ],
            2,
            f"error: model directory not found: {tmp_path / 'nope'}",
        ),
        (
            [
                "calibrate",
                str(tiny_llama_master),
                "--dataset",
                str(text_dataset),
                "-o",
                str(tmp_path / "o"),
                "--text-column",
                "body",
            ],
            1,
            "error: dataset",
        ),
        (
            [
                "calibrate",
                str(tiny_llama_master),
                "--dataset",
                str(text_dataset),
                "-o",
                str(tmp_path),
            ],
            2,
            f"error: output {tmp_path} already exists",
        ),
    ]
    for args, code, first_line in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.stderr)
        lines = [
            line
            for line in result.stderr.strip().splitlines()
            if not line.startswith("calibrate: ")
        ]
        assert lines[0].startswith(first_line), (
            result.stderr
        )  # after any progress line the work got to
        assert lines[-1].startswith("hint: "), result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "o").exists()


def test_python_dash_m_works():
    proc = subprocess.run(
        [sys.executable, "-m", "kvcalib", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("calibrate", "validate"):
        assert command in proc.stdout


def _calibrated_copy(tiny_llama_master, tmp_path):
    import shutil

    from checkpoints import make_calibrated

    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_master, dst)
    return make_calibrated(dst)


def test_validate_exit_codes_and_json(tiny_llama_master, tmp_path):
    ckpt = _calibrated_copy(tiny_llama_master, tmp_path)
    ok = runner.invoke(app, ["validate", str(ckpt), "--json"])
    assert ok.exit_code == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert set(payload) == {"checkpoint", "target", "ok", "findings"}
    assert payload["ok"] is True and payload["target"] == "trn2"
    assert "OK: 0 error(s)" in ok.stderr

    # a warning: fine unless --strict
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"], config["model_type"] = ["MistralForCausalLM"], "mistral"
    (ckpt / "config.json").write_text(json.dumps(config))
    assert runner.invoke(app, ["validate", str(ckpt)]).exit_code == 0
    strict = runner.invoke(app, ["validate", str(ckpt), "--strict", "--json"])
    assert strict.exit_code == 1
    assert [f["rule"] for f in json.loads(strict.stdout)["findings"]] == ["PORT-NO-SCALE-LOADER"]

    # an error
    (ckpt / "kv_scales.safetensors").unlink()
    bad = runner.invoke(app, ["validate", str(ckpt), "--json"])
    assert bad.exit_code == 1
    rules = {f["rule"] for f in json.loads(bad.stdout)["findings"] if f["severity"] == "error"}
    assert "CKPT-INDEX-FILE-MISSING" in rules
    assert "FAILED" in bad.stderr and "Traceback" not in bad.stderr


def test_validate_unreadable_is_exit_2(tmp_path):
    missing = runner.invoke(app, ["validate", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert missing.stderr.startswith(f"error: checkpoint directory not found: {tmp_path / 'nope'}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    broken = runner.invoke(app, ["validate", str(tmp_path / "ckpt")])
    assert broken.exit_code == 2 and "cannot parse config.json" in broken.stderr
    target = runner.invoke(app, ["validate", str(tmp_path / "ckpt"), "--target", "a100"])
    assert (
        target.exit_code == 2 and "'a100' is not one of 'trn2', 'trn3', 'gpu'" in target.stderr
    )  # --help lists them


# --- what a user sees in a log: plain progress lines, --quiet, --json, --version ----------------------


def test_progress_lines_without_a_terminal(tiny_llama_master, text_dataset, tmp_path, monkeypatch):
    """stderr that is no terminal (CliRunner's, a log file, CI) gets plain lines instead of the bar."""
    from kvcalib.cli import render

    monkeypatch.setattr(render, "PLAIN_INTERVAL_S", 0.0)  # every update; 30 s in real runs
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "out"),
            "--num-samples",
            "6",
            "--batch-size",
            "1",
            "--max-seq-len",
            "32",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("calibrate:")]
    samples = [line.split()[1] for line in lines if " samples, " in line]
    assert lines[:2] == ["calibrate: reading dataset", "calibrate: loading model"]
    assert samples[0] == "0/6" and samples[-1] == "6/6" and len(samples) >= 4, lines
    assert all(
        " tokens, " in line and " tok/s, ETA " in line for line in lines if " samples, " in line
    )
    assert "calibrate: writing checkpoint" in lines


def test_progress_through_a_real_pipe_starts_and_ends(tiny_llama_master, text_dataset, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcalib",
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "out"),
            "--num-samples",
            "4",
            "--max-seq-len",
            "32",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_samples"] == 4  # stdout stays pure JSON
    lines = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("calibrate: ") and " samples, " in line
    ]
    assert lines[0].startswith("calibrate: 0/4 samples") and lines[-1].startswith(
        "calibrate: 4/4 samples"
    ), lines


def test_quiet_prints_nothing_but_errors(tiny_llama_master, text_dataset, tmp_path):
    """As a process (the libraries' own bars are silenced by the CLI's entry point, as for every user)."""
    import subprocess
    import sys

    def kvcalib(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvcalib", *args], capture_output=True, text=True, check=False
        )

    args = (
        "calibrate",
        str(tiny_llama_master),
        "--dataset",
        str(text_dataset),
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
        "--quiet",
    )
    quiet = kvcalib(*args, "-o", str(tmp_path / "a"))
    assert (quiet.returncode, quiet.stderr, quiet.stdout) == (0, "", "")
    as_json = kvcalib(*args, "-o", str(tmp_path / "b"), "--json")
    assert (
        as_json.returncode == 0
        and as_json.stderr == ""
        and json.loads(as_json.stdout)["target"] == "trn2"
    )
    failed = kvcalib(*args, "-o", str(tmp_path / "a"))  # exists: an error is still said
    assert (
        failed.returncode == 2
        and failed.stderr.startswith("error: output")
        and "hint:" in failed.stderr
    )
    validated = kvcalib("validate", str(tmp_path / "a"), "--quiet")
    assert (validated.returncode, validated.stderr, validated.stdout) == (0, "", "")


def test_version():
    from kvcalib import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"kvcalib {__version__}\n"
