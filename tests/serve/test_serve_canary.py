"""The canary, the prediction, `calibrate --serve-check` and `--device cuda`, against the fake vLLM.

The fake honours KV scales as a real server does (the share of K/V that saturates costs
log-prob, and past half of it the answers diverge), unless told to ignore them
(FAKE_VLLM_MODE=ignore-scales, the bug class the canary exists for) or to apply them the
wrong way round (inverted-scales). The CUDA paths use a fake CUDA torch and vLLM platform.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_helpers import assert_nothing_left, fake_python, processes_mentioning, serve
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.serving.canary import CANARY_DIVISOR, MIN_NLL_CHANGE
from kvcalib.validation.pipeline import validate_checkpoint

runner = CliRunner()


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_an_honest_server_passes_the_canary(ckpt, cpu_python):
    before = tree(ckpt)
    result = serve(ckpt, cpu_python, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    canary = payload["canary"]
    assert canary["ok"] is True and canary["factor"] == 1 / CANARY_DIVISOR
    assert canary["nll"] >= payload["nll"]["fp8"] + MIN_NLL_CHANGE and canary["agreement"] < 0.5
    assert "the server applies the checkpoint's scales" in canary["reason"]
    assert [row["name"] for row in payload["variants"]] == [
        "baseline",
        "calibrated",
        "scales 1.0",
        "scales x0.015625",
    ]
    assert payload["unit"]["nll"] == pytest.approx(
        payload["nll"]["fp8"], abs=0.01
    )  # 1.0 saturates nothing here
    prediction = payload["prediction"]
    assert (
        prediction["target"] == "vllm-cpu"
    )  # the numbers themselves: a random tiny model barely reacts (see e2e)
    assert all(
        isinstance(prediction[k], float)
        for k in ("delta_nll", "unit_delta_nll", "canary_delta_nll")
    )
    delta = payload["delta_nll"]
    assert delta["served"] == pytest.approx(payload["nll"]["fp8"] - payload["nll"]["baseline"])
    assert delta["predicted"] == prediction["delta_nll"]
    assert delta["intervals"]["served"]["estimate"] == pytest.approx(delta["served"])
    assert delta["intervals"]["predicted"]["estimate"] == pytest.approx(delta["predicted"])
    variant = Path(payload["log"]).parent / "variants" / "scales-div64"
    assert (variant / "config.json").is_symlink() and not (
        variant / "kv_scales.safetensors"
    ).is_symlink()
    assert tree(ckpt) == before  # the variants never write through to the checkpoint
    assert "canary: ok" in result.stderr and "predicted ΔNLL" in result.stderr
    assert_nothing_left(str(ckpt), result.stderr)
    # the same --log-dir: the variants are made anew
    again = serve(ckpt, cpu_python, "--device", "cpu", "--no-baseline", "--no-predict", "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["canary"]["ok"] and tree(ckpt) == before
    (variant / "notes.txt").write_text("mine")  # what serve-check did not make is never deleted
    refused = serve(ckpt, cpu_python, "--device", "cpu", "--no-predict", "--json")
    assert (
        refused.exit_code == 2
        and f"{variant} exists and is not a checkpoint variant serve-check made" in refused.stderr
    ), refused.stderr
    assert (variant / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("ignore-scales", "the server did not apply the checkpoint's KV scales"),
        ("inverted-scales", "the server applies the checkpoint's KV scales the wrong way round"),
    ],
)
def test_a_server_that_mishandles_the_scales_fails(ckpt, cpu_python, monkeypatch, mode, message):
    result = serve(
        ckpt,
        cpu_python,
        "--device",
        "cpu",
        "--no-predict",
        "--json",
        env={"FAKE_VLLM_MODE": mode},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 1, result.stderr
    payload = json.loads(result.stdout)
    assert payload["canary"]["ok"] is False and payload["canary"]["reason"].startswith(message)
    assert any(f.startswith(message) and "on cpu, vllm" in f for f in payload["failures"]), payload[
        "failures"
    ]
    assert "FAILED" in result.stderr
    assert_nothing_left(str(ckpt), result.stderr)


def test_no_canary_runs_two_servers(ckpt, cpu_python):
    result = serve(ckpt, cpu_python, "--device", "cpu", "--no-canary", "--no-predict", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["canary"] is None and payload["unit"] is None and payload["prediction"] is None
    assert sorted(p.name for p in (ckpt.parent / "logs").glob("*.log")) == [
        "vllm-baseline.log",
        "vllm-fp8.log",
    ]
    assert any("the canary is off" in w for w in payload["warnings"])


def test_neuron_runs_no_canary_by_default_and_says_so(ckpt, neuron_env, monkeypatch):
    result = serve(
        ckpt,
        neuron_env,
        "--device",
        "trn2",
        "--json",
        env={"FAKE_NEURON_LS": "trn2", "FAKE_NEURON_DEVICES": "1"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["canary"] is None and payload["prediction"]["target"] == "trn2"
    assert any(
        "the canary is off (on Neuron each variant is another compile)" in w
        for w in payload["warnings"]
    )
    with_canary = serve(
        ckpt,
        neuron_env,
        "--device",
        "trn2",
        "--canary",
        "--no-predict",
        "--json",
        env={"FAKE_NEURON_LS": "trn2", "FAKE_NEURON_DEVICES": "1"},
        monkeypatch=monkeypatch,
    )
    assert with_canary.exit_code == 0, with_canary.stderr
    assert json.loads(with_canary.stdout)["canary"]["ok"] is True
    assert_nothing_left(str(ckpt), with_canary.stderr)


# --- GPU vLLM -------------------------------------------------------------------------------------


@pytest.fixture
def cuda_python(tmp_path) -> Path:
    return fake_python(tmp_path / "fake-cuda", cuda=True)


def test_cuda_serves_without_eager_and_proves_the_scales(ckpt448, cuda_python, monkeypatch):
    result = serve(
        ckpt448,
        cuda_python,
        "--device",
        "cuda",
        "--json",
        env={"FAKE_VLLM_PLATFORM": "cuda"},
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (
        "--kv-cache-dtype fp8" in payload["command"] and "--enforce-eager" not in payload["command"]
    )
    assert (
        "--kv-cache-memory-bytes" not in payload["command"] and payload["tensor_parallel_size"] == 1
    )
    assert payload["canary"]["ok"] is True and payload["unit"] is None  # 1.0 is cheap on CPU only
    assert_nothing_left(str(ckpt448), result.stderr)


@pytest.mark.parametrize(
    ("python", "env", "code", "message"),
    [
        (
            "cuda",
            {"FAKE_VLLM_PLATFORM": "cuda", "FAKE_CUDA_DEVICES": "0"},
            3,
            "no CUDA device is visible to",
        ),
        ("cuda", {"FAKE_VLLM_PLATFORM": "cpu"}, 3, "is not a CUDA build (its platform is 'cpu')"),
        ("cpu", {"FAKE_VLLM_PLATFORM": "cuda"}, 3, "is a CPU build: no CUDA"),
        ("cuda", {"FAKE_VLLM_PLATFORM": "cuda", "FAKE_VLLM_MODE": "crash"}, 4, "exited"),
        (
            "cuda",
            {"FAKE_VLLM_PLATFORM": "cuda", "FAKE_CUDA_DEVICES": "1"},
            2,
            "--tp 2 needs 2 GPUs",
        ),
    ],
    ids=["no-device", "cpu-only-vllm", "cpu-torch", "server-crash", "tp-too-large"],
)
def test_cuda_failures(ckpt448, cuda_python, cpu_python, monkeypatch, python, env, code, message):
    extra = ("--tp", "2") if "tp" in message else ()
    result = serve(
        ckpt448,
        cuda_python if python == "cuda" else cpu_python,
        "--device",
        "cuda",
        *extra,
        env=env,
        monkeypatch=monkeypatch,
    )
    assert result.exit_code == code, result.stderr
    assert message in result.stderr and "hint:" in result.stderr, result.stderr
    assert_nothing_left(str(ckpt448), result.stderr)


# --- calibrate --serve-check ---------------------------------------------------------------------


def calibrate_and_serve(model: Path, data: Path, out: Path, *extra: str):
    args = [
        "calibrate",
        str(model),
        "--dataset",
        str(data),
        "-o",
        str(out),
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
        "--log-dir",
        str(out.parent / "logs"),
        *extra,
    ]
    result = runner.invoke(app, args)
    assert "Traceback" not in result.stderr.split("--- last lines of")[0], result.stderr
    return result


def test_calibrate_then_serve_check(head32_model, text_dataset, cpu_python, tmp_path):
    out = tmp_path / "out"
    result = calibrate_and_serve(
        head32_model,
        text_dataset,
        out,
        "--serve-check",
        "cpu",
        "--target",
        "gpu",
        "--vllm-python",
        str(cpu_python),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"calibration", "serve_check"}
    assert payload["calibration"]["output"] == str(out) and payload["serve_check"][
        "checkpoint"
    ] == str(out)
    assert payload["serve_check"]["ok"] is True and payload["serve_check"]["canary"]["ok"] is True
    assert "KV scales for gpu" in result.stderr and "PASSED" in result.stderr
    card = (out / "README.md").read_text()  # the model card has serve-check's figures too
    assert (
        "### serve-check" in card
        and "on cpu" not in card
        and ": passed." in card
        and "| calibrated |" in card
    )
    assert_nothing_left(str(out), result.stderr)


def test_calibrate_then_a_failing_serve_check_keeps_the_checkpoint(
    head32_model, text_dataset, cpu_python, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_VLLM_MODE", "degenerate")
    out = tmp_path / "out"
    result = calibrate_and_serve(
        head32_model,
        text_dataset,
        out,
        *("--serve-check", "cpu", "--vllm-python", str(cpu_python), "--no-canary", "--no-predict"),
    )
    assert result.exit_code == 1, result.stderr  # serve-check's exit code
    assert validate_checkpoint(out, "trn2").ok and "degenerate output" in result.stderr
    assert_nothing_left(str(out), result.stderr)


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (("--serve-check", "trn2"), 3, "no Neuron devices"),
        (
            ("--serve-check", "cpu", "--vllm-python", "{tmp}/none"),
            3,
            "--vllm-python {tmp}/none is not an executable interpreter: no such file",
        ),
        (
            ("--serve-check", "cpu", "--target", "gpu", "--max-model-len", "0"),
            2,
            "--max-model-len must be at least 1",
        ),
        (
            ("--serve-check", "trn2", "--target", "gpu"),
            2,
            "--target gpu sizes the scales for FP8 max 448",
        ),
        (("--serve-check", "tpu"), 2, "'tpu' is not one of 'trn2', 'trn3', 'cpu', 'cuda'"),
        (("--serve-check", "cpu", "--model16"), 3, "head size 16 is not divisible by 32"),
    ],
    ids=[
        "no-neuron",
        "no-vllm-python",
        "max-model-len",
        "target-too-wide",
        "unknown-device",
        "head-size",
    ],
)
def test_calibrate_serve_check_preflight_stops_before_any_model_is_loaded(
    head32_model,
    tiny_llama_master,
    text_dataset,
    cpu_python,
    neuron_env,
    tmp_path,
    monkeypatch,
    extra,
    code,
    message,
):
    monkeypatch.setenv("FAKE_NEURON_LS", "empty")
    model = tiny_llama_master if "--model16" in extra else head32_model
    extra = tuple(e.format(tmp=tmp_path) for e in extra if e != "--model16")
    python = neuron_env if "trn2" in extra else cpu_python
    if "--vllm-python" not in extra:
        extra += ("--vllm-python", str(python))
    result = calibrate_and_serve(model, text_dataset, tmp_path / "out", *extra)
    assert result.exit_code == code, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr, result.stderr
    # a device --serve-check does not list: the CLI refuses it itself, listing the devices, with no hint
    assert "hint:" in result.stderr or "is not one of" in message, result.stderr
    # calibration's first progress line: "calibrate: reading dataset", before the model is loaded
    assert "calibrate: " not in result.stderr and "KV scales for" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("fake-")) == []
    assert processes_mentioning(str(tmp_path)) == []
