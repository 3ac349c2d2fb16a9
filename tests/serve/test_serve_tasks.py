"""serve-check --tasks against the fake vLLM server: lm-eval's own completions model on both servers, paired item by
item, next to kvcalib's prediction of the same items (the real vLLM CPU run is in the README)."""

from __future__ import annotations

import json

import pytest
from serve_helpers import assert_nothing_left, serve
from tasks import write_tiny_tasks


def test_the_tasks_run_on_both_servers_next_to_the_prediction(ckpt, cpu_python, tmp_path):
    write_tiny_tasks(tmp_path / "task-data" / "tasks")
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-canary",
        "--tasks",
        "kvcalib_tiny_mc,kvcalib_tiny_gen",
        "--task-data",
        str(tmp_path / "task-data"),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    rows = {row["task"]: row for row in payload["tasks"]}
    mc = rows["kvcalib_tiny_mc"]
    assert mc["metric"] == "acc" and mc["items"] == 6
    served, predicted = mc["served"], mc["predicted"]
    assert 0 <= served["baseline"] <= 1 and 0 <= served["fp8"] <= 1
    assert served["interval"]["items"] == 6
    assert served["interval"]["estimate"] == pytest.approx(served["fp8"] - served["baseline"])
    assert (
        predicted["numerics"] == "vllm-cpu" and predicted["interval"]["items"] == 6
    )  # the same items, emulated
    assert rows["kvcalib_tiny_gen"]["metric"] == "exact_match"
    assert "lm-eval tasks served" in result.stderr and "PASSED" in result.stderr
    assert_nothing_left(str(ckpt), result.stderr)


def test_task_flags_are_checked_before_any_server_starts(ckpt, cpu_python, tmp_path):
    write_tiny_tasks(tmp_path / "task-data" / "tasks")
    data = ["--task-data", str(tmp_path / "task-data")]
    for extra, message in (
        (
            ["--tasks", "kvcalib_tiny_mc", "--no-baseline", *data],
            "--tasks pairs the FP8 server's scores",
        ),
        (["--limit", "5"], "--limit and --task-data go with --tasks"),
        (["--tasks", "kvcalib_tiny_mcc", *data], "unknown task 'kvcalib_tiny_mcc'"),
        (["--tasks", "kvcalib_tiny_mc", "--limit", "0", *data], "--limit"),
    ):
        result = serve(ckpt, cpu_python, "--device", "cpu", "--no-canary", *extra)
        assert result.exit_code == 2 and message in result.stderr, (extra, result.stderr)
        assert "server:" not in result.stderr  # nothing was started
