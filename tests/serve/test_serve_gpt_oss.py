"""GPT-OSS with MXFP4 experts on Neuron: the fake plugin's paths, each as the fork's GPT-OSS code takes it
(tests/support/fakes/neuron/vllm_neuron/gpt_oss.py: factory, model_bf16, model_mxfp4, the KV-scale loader, and the
platform's quantization check), and serve-check on kvcalib's Neuron form, which names the neuron_config
quantization each chip needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from mxfp4 import build_gpt_oss_mxfp4
from safetensors.torch import load_file, save_file
from serve_helpers import FAKE_BIN, assert_nothing_left, fake_python, serve

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.serving.launch import server_argv
from kvcalib.serving.options import ServeOptions
from kvcalib.serving.server import free_port

LAYERS = 3
SCALES = "kv_scales.safetensors"


@pytest.fixture(scope="module")
def forms(tmp_path_factory, text_dataset) -> dict[str, Path]:
    """released: as GPT-OSS ships (MXFP4 config); trn2 / trn3: kvcalib's Neuron form for that chip (MXFP4 experts
    linked, KV-only config); dequantized: the experts in bf16 (the GPU form), calibrated for trn2."""
    from kvcalib.hf.mxfp4 import dequantize_mxfp4

    root = tmp_path_factory.mktemp("gpt-oss")
    forms = {"released": build_gpt_oss_mxfp4(root / "released", layers=LAYERS)}
    bf16 = dequantize_mxfp4(forms["released"], root / "bf16")
    for name, source, target in (
        ("trn2", forms["released"], "trn2"),
        ("trn3", forms["released"], "trn3"),
        ("dequantized", bf16, "trn2"),
    ):
        forms[name] = root / name
        calibrate(
            source,
            str(text_dataset),
            forms[name],
            CalibrateOptions(target=target, num_samples=4, max_seq_len=32),
        )
    return forms


def start(
    model: Path, python: Path, chip: str, neuron_config: dict | None, kv: str = "fp8"
) -> tuple[int | None, str]:
    """Start the fake server on a Neuron host of `chip` until it serves or exits: (exit code or None, its output)."""
    argv = server_argv(
        ServeOptions(chip, max_model_len=256, vllm_python=python),
        model,
        free_port(),
        kv == "fp8",
        neuron_quantization=(neuron_config or {}).get("quantization"),
    )
    env = {**os.environ, "FAKE_NEURON_LS": chip, "FAKE_VLLM_HEALTH_DELAY": "0"}
    env.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Starting vLLM API server" in line:
                return None, "".join(lines)
        return proc.wait(timeout=30), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def neuron_python(tmp_path_factory) -> Path:
    return fake_python(tmp_path_factory.mktemp("fake-neuron"), neuron=True)


@pytest.mark.parametrize(
    "form, chip, neuron_config, code, expected",
    [
        # the platform's check: the released MXFP4 config is refused unless the CPU-dequant waiver is named ...
        (
            "released",
            "trn2",
            None,
            1,
            "ValueError: Neuron does not support MX quantization: quant_method='mxfp4'",
        ),
        # ... and under the waiver it serves, the experts dequantised, every scale 1.0 (there are none)
        (
            "released",
            "trn2",
            {"quantization": "mxfp8"},
            None,
            "model_bf16: 6 MXFP4 expert weights dequantised to bf16 at "
            "load|KV cache scales: 0 of 6 read",
        ),
        # kvcalib's form: the factory's choice by neuron_config quantization, else by chip; the scales read
        (
            "trn2",
            "trn2",
            None,
            None,
            "on trn2: model_bf16|6 MXFP4 expert weights dequantised|6 of 6 read",
        ),
        (
            "trn2",
            "trn2",
            {"quantization": "bf16"},
            None,
            "on trn2: model_bf16|6 MXFP4 expert weights dequantised|6 of 6",
        ),
        (
            "trn2",
            "trn2",
            {"quantization": "mxfp8"},
            None,
            "on trn2: model_bf16|6 of 6 read",
        ),  # the waiver's reading too
        (
            "trn2",
            "trn2",
            {"quantization": "mxfp4"},
            1,
            "ValueError: quantization='mxfp4' is not supported on TRN2. Please use quantization='bf16'",
        ),
        (
            "trn3",
            "trn3",
            None,
            None,
            "on trn3: model_mxfp4|6 MXFP4 expert weights loaded as MXFP4|6 of 6 read",
        ),
        (
            "trn3",
            "trn3",
            {"quantization": "mxfp4"},
            None,
            "on trn3: model_mxfp4|loaded as MXFP4|6 of 6 read",
        ),
        (
            "trn3",
            "trn3",
            {"quantization": "bf16"},
            None,
            "on trn3: model_bf16|dequantised to bf16 at load|6 of 6 read",
        ),
        # the dequantised form: model_bf16 reads bf16 experts; model_mxfp4 has no MXFP4 pair to read
        ("dequantized", "trn2", None, None, "model_bf16: experts read as bf16|6 of 6 read"),
        (
            "dequantized",
            "trn3",
            None,
            1,
            "model_mxfp4: 12 tensors its mapping names are not in the checkpoint|"
            "KeyError: 'model.layers.0.mlp.experts.gate_up_proj_blocks'",
        ),
    ],
)
def test_the_fake_plugin_takes_the_forks_gpt_oss_paths(
    forms, neuron_python, form, chip, neuron_config, code, expected
):
    exit_code, output = start(forms[form], neuron_python, chip, neuron_config)
    assert exit_code == code, output
    for part in expected.split("|"):
        assert part in output, (part, output)


def test_the_scale_loader_reads_what_the_fork_reads(forms, neuron_python, tmp_path):
    """Only for an FP8 cache; exactly model.layers.{i}.self_attn.k_scale / v_scale (a misnamed one runs at 1.0,
    silently); a 0-d scale cannot be sliced and a 2-element one cannot be reshaped to (1, 1)."""
    _, output = start(forms["trn2"], neuron_python, "trn2", None, kv="bfloat16")
    assert "KV cache scales" not in output and "model_bf16" in output
    variants = {
        "misnamed": (
            lambda s: {
                k.replace("layers.1.self_attn.k_scale", "layers.1.attn.k_scale"): v
                for k, v in s.items()
            },
            None,
            "KV cache scales: 5 of 6 read",
        ),
        "0-d": (
            lambda s: {k: v.reshape(()) if "layers.2" in k else v for k, v in s.items()},
            1,
            "IndexError: slice() cannot be applied to a 0-dim tensor.",
        ),
        "two": (
            lambda s: {k: v.repeat(2) if "layers.0.self_attn.v" in k else v for k, v in s.items()},
            1,
            "RuntimeError: shape '[1, 1]' is invalid for input of size 2",
        ),
    }
    for name, (change, code, expected) in variants.items():
        model = tmp_path / name
        model.mkdir()
        for entry in forms["trn2"].iterdir():
            if entry.name != SCALES:
                (model / entry.name).symlink_to(entry)
        save_file(change(load_file(forms["trn2"] / SCALES)), str(model / SCALES))
        exit_code, output = start(model, neuron_python, "trn2", None)
        assert exit_code == code and expected in output, (name, output)


@pytest.mark.parametrize(
    "chip, quantization, model", [("trn2", "bf16", "model_bf16"), ("trn3", "mxfp4", "model_mxfp4")]
)
def test_serve_check_serves_the_mxfp4_form_with_the_chips_quantization(
    forms, tmp_path, monkeypatch, chip, quantization, model
):
    """serve-check --device trn2/trn3 on kvcalib's Neuron form names the neuron_config quantization the fork's
    factory needs for that chip, as the model card does; the fake plugin loads the MXFP4 experts and every scale."""
    monkeypatch.setenv("PATH", f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    ckpt = tmp_path / f"gpt-oss-{chip}"
    ckpt.mkdir()
    for entry in forms[chip].iterdir():
        (ckpt / entry.name).symlink_to(entry)
    result = serve(
        ckpt,
        fake_python(tmp_path / "py", neuron=True),
        "--device",
        chip,
        "--json",
        env={"FAKE_NEURON_LS": chip},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (
        payload["ok"]
        and f"""--additional-config '{{"neuron_config": {{"quantization": "{quantization}"}}}}'"""
        in payload["command"]
    ), payload["command"]
    log = Path(payload["log"]).read_text()
    assert (
        f"GptOssForCausalLM on {chip}: {model}" in log
        and f"KV cache scales: {2 * LAYERS} of {2 * LAYERS} read" in log
    )
    card = (forms[chip] / "README.md").read_text()
    assert f'"quantization": "{quantization}"' in card
    assert_nothing_left(str(ckpt), result.stderr)


def test_serve_check_refuses_the_mxfp4_form_off_neuron(forms, tmp_path, monkeypatch):
    """On CPU (and GPU) vLLM would run the MXFP4 experts at KV scale 1.0 or not load them: refused before a start."""
    result = serve(
        forms["trn2"], fake_python(tmp_path / "py"), "--device", "cpu", monkeypatch=monkeypatch
    )
    assert result.exit_code != 0 and "PORT-MXFP4-GPU" in result.stderr, result.stderr
    assert not (forms["trn2"].parent / "logs").exists() or not list(
        (forms["trn2"].parent / "logs").glob("vllm-*.log")
    )
