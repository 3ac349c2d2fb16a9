"""Interrupting a real `kvcalib calibrate --overwrite` at every step, then running it again.

A child process (tests/support/interruptible.py) runs the real CLI and stops at
one point: while calibrating, while writing the staging directory, just before the atomic
exchange, just after it, and between the two renames of the fallback publish. The test
sends SIGINT, SIGTERM, SIGHUP or SIGKILL there, then checks that OUT holds the old
checkpoint, the new one (whole and valid) or, only after SIGKILL between the fallback's
renames, nothing, with the old one kept for the next run to restore. The rerun must finish,
say what it restored or removed, and leave no sibling.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_corpus import snapshot
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.core.records import to_json
from kvcalib.core.schema import PROVENANCE_FILENAME
from kvcalib.validation.pipeline import validate_checkpoint

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "support" / "interruptible.py"
K, T, INT, H = signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP

# (point, signal, what OUT holds afterwards). Inside the publish step signals are deferred until
# the new checkpoint is in place, so SIGTERM there ends with the new one (and exit 128+N).
# SIGINT, SIGTERM and SIGHUP reach one handler: each is sent once. SIGKILL is sent at every point
# that has written something (while observing, nothing has: SIGHUP there).
SCENARIOS = [
    ("observe", H, "old"),
    ("write", INT, "old"),
    ("write", K, "old"),
    ("publish", T, "new"),
    ("publish", K, "old"),
    ("exchanged", K, "new"),
    ("between", K, "absent"),
]


@pytest.fixture(scope="module")
def inputs(
    tmp_path_factory, tiny_llama_master: Path, short_dataset: Path, handmade_master: Path
) -> dict[str, Path]:
    old = shutil.copytree(
        handmade_master, tmp_path_factory.mktemp("interrupt") / "old"
    )  # what OUT holds before
    return {"model": tiny_llama_master, "data": short_dataset, "old": old}


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def state_of(out: Path, old: dict) -> str:
    if not out.exists():
        return "absent"
    if snapshot(out) == old:
        return "old"
    provenance = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert provenance.get("tool") == "kvcalib", provenance
    report = validate_checkpoint(out, "trn2")
    assert report.ok, to_json(report)
    return "new"


def wait_for(proc: subprocess.Popen, line: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = proc.stdout.readline()
            seen += chunk
            if chunk.strip() == line:
                return
            if not chunk and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"never reached {line!r}: {seen}\n{proc.stderr.read()}")


@pytest.mark.parametrize(
    ("point", "sig", "expected"),
    SCENARIOS,
    ids=[f"{p}-{signal.Signals(s).name}" for p, s, _ in SCENARIOS],
)
def test_interrupt_then_rerun(point, sig, expected, inputs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(inputs["old"], out)
    old = snapshot(out)
    args = [
        str(inputs["model"]),
        "--dataset",
        str(inputs["data"]),
        "-o",
        str(out),
        "--overwrite",
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), point, "--", "calibrate", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(proc, f"AT {point}")
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert rc == (-sig if sig == K else 128 + sig), stderr
    if sig != K:
        assert (
            f"interrupted ({signal.Signals(sig).name})" in stderr and "Traceback" not in stderr
        ), stderr
        assert siblings(out) == [], stderr  # cleaned up on the way out
    assert state_of(out, old) == expected, stderr
    left = siblings(out)

    result = CliRunner().invoke(app, ["calibrate", *args])
    assert result.exit_code == 0, result.output
    if left:  # what a killed run left is reported, and restored or removed
        assert "left by an interrupted run" in result.output, result.output
    if expected == "absent":
        assert f"restored the previous {out}" in result.output, result.output
    assert siblings(out) == [], result.output
    assert state_of(out, old) == "new"


def test_stale_sibling_of_a_live_run_is_not_touched(inputs, tmp_path):
    """A staging directory whose writer still runs: refused (two runs must not write one output), kept."""
    out = tmp_path / "out"
    args = [
        str(inputs["model"]),
        "--dataset",
        str(inputs["data"]),
        "-o",
        str(out),
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "write", "--", "calibrate", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(proc, "AT write")
        left = siblings(out)
        assert len(left) == 1
        result = CliRunner().invoke(app, ["calibrate", *args])
        assert (
            result.exit_code == 2
            and "another kvcalib" in result.output
            and "hint:" in result.output
        )
        assert siblings(out) == left
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert siblings(out) == [] and not out.exists()


@pytest.mark.parametrize(("command", "sig"), [("eval", T), ("validate", H), ("tasks", INT)])
def test_eval_and_validate_exit_like_ctrl_c(command, sig, inputs, task_dir, tmp_path):
    """Stopped mid-run, eval (with --plot), eval-tasks (inside lm-eval's scoring, run from an empty folder) and
    validate exit as Ctrl-C does, write nothing and leave the checkpoint as it was."""
    plot = tmp_path / "plot.png"
    args = {
        "eval": [
            "eval",
            str(inputs["old"]),
            "--dataset",
            str(inputs["data"]),
            "--num-samples",
            "2",
            "--plot",
            str(plot),
        ],
        "validate": ["validate", str(inputs["old"])],
        "tasks": [
            "eval-tasks",
            str(inputs["old"]),
            "--tasks",
            "kvcalib_tiny_mc",
            "--compare",
            "unit",
            "--include-path",
            str(task_dir),
        ],
    }[command]
    before = snapshot(inputs["old"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), command, "--", *args],
        env=env,
        text=True,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for(proc, f"AT {command}")
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 128 + sig
    stderr = proc.stderr.read()
    assert f"interrupted ({signal.Signals(sig).name})" in stderr and "Traceback" not in stderr, (
        stderr
    )
    assert os.listdir(tmp_path) == [] and snapshot(inputs["old"]) == before
