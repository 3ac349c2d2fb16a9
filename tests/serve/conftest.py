"""The serve-check tests' shared checkpoints and fake interpreters (tests/support/fakes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from serve_helpers import FAKE_BIN, FAKE_HOST_CPU_FLAGS, build_llama_head32, fake_python

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate


@pytest.fixture(autouse=True)
def fake_host(monkeypatch):
    """The fake host's CPU (AVX-512), and a fake vLLM healthy at once (hung or failing starts have their own modes)."""
    monkeypatch.setenv("KVCALIB_CPU_FLAGS", FAKE_HOST_CPU_FLAGS)
    monkeypatch.setenv("FAKE_VLLM_HEALTH_DELAY", "0")


@pytest.fixture(scope="session")
def head32_model(tmp_path_factory) -> Path:
    """A small bf16 Llama with head_dim 32 (vLLM's CPU FP8 KV cache needs a multiple of 32). Do not modify."""
    return build_llama_head32(tmp_path_factory.mktemp("head32-model") / "llama")


@pytest.fixture(scope="session")
def head32_calibrated(tmp_path_factory, text_dataset, head32_model) -> dict[str, Path]:
    """The head-32 Llama calibrated for trn2 (max 240) and for gpu (max 448)."""
    root = tmp_path_factory.mktemp("head32")
    model = head32_model
    out = {}
    for target in ("trn2", "gpu"):
        out[target] = root / f"llama-{target}"
        calibrate(
            model,
            str(text_dataset),
            out[target],
            CalibrateOptions(target=target, num_samples=4, max_seq_len=32),
        )
    return out


@pytest.fixture
def ckpt(head32_calibrated, tmp_path) -> Path:
    """A private copy (its path marks this test's server processes)."""
    dst = tmp_path / "ckpt-trn2"
    shutil.copytree(head32_calibrated["trn2"], dst)
    return dst


@pytest.fixture
def ckpt448(head32_calibrated, tmp_path) -> Path:
    dst = tmp_path / "ckpt-gpu"
    shutil.copytree(head32_calibrated["gpu"], dst)
    return dst


@pytest.fixture
def cpu_python(tmp_path) -> Path:
    return fake_python(tmp_path / "fake-cpu")


@pytest.fixture
def neuron_env(tmp_path, monkeypatch) -> Path:
    """A Neuron host: the fake neuron-ls on PATH, and a python whose vLLM has the Neuron plugin."""
    monkeypatch.setenv("PATH", f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    return fake_python(tmp_path / "fake-neuron", neuron=True)
