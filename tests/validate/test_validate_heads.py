"""validate on per-head and FP8-attention checkpoints: the Neuron platform's verdict, GPU vLLM's needs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import sync_index
from safetensors.torch import load_file, save_file
from test_validate_property import platform_oracle

from kvcalib.core.schema import SCALES_FILENAME, kv_only_quantization_config
from kvcalib.validation.config import neuron_quantization_verdict
from kvcalib.validation.pipeline import validate_checkpoint


@pytest.fixture(scope="module")
def checkpoints(calibrate_tiny) -> dict[str, Path]:
    return {
        name: calibrate_tiny(**options)
        for name, options in {
            "per-head": dict(target="gpu", strategy="attn_head"),
            "per-head-q": dict(target="gpu", strategy="attn_head", attention_scales=True),
            "tensor-q-trn2": dict(target="trn2", attention_scales=True),
        }.items()
    }


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def rules(report, severity: str | None = None) -> set[str]:
    return {f.rule for f in report.findings if severity is None or f.severity == severity}


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_the_neuron_platform_accepts_the_fp8_attention_config(strategy):
    """kvcalib's FP8-attention quantization_config through the platform's rules (the spec's, independently coded)
    and through kvcalib's exact copy of them: accepted, because the one target contains 'Attention'."""
    qc = kv_only_quantization_config(strategy, ("LlamaAttention",))
    platform_oracle(qc, None)  # raises if the platform refuses it
    assert neuron_quantization_verdict(qc) is None
    for other in ("Qwen3Attention", "Qwen3MoeAttention", "GptOssAttention"):
        platform_oracle(kv_only_quantization_config(strategy, (other,)), None)
    # the guard: the same group on a target without "Attention" is refused, by both
    refused = kv_only_quantization_config(strategy, ("LlamaAttention",))
    refused["config_groups"]["attention"]["targets"] = ["re:.*self_attn$"]
    with pytest.raises(ValueError, match="Input activation quantization on non-attention targets"):
        platform_oracle(refused, None)
    assert neuron_quantization_verdict(refused).rule == "NEURON-QCFG-INPUT-ACT"


def test_per_head_verdicts(checkpoints):
    for name in ("per-head", "per-head-q"):
        gpu = validate_checkpoint(checkpoints[name], "gpu")
        assert gpu.ok, gpu.errors
        strategy = [f for f in gpu.findings if f.rule == "PORT-KV-SCHEME-STRATEGY"]
        assert [f.severity for f in strategy] == ["info"] and "FlashAttention" in strategy[
            0
        ].message
        for target in ("trn2", "trn3"):
            neuron = validate_checkpoint(checkpoints[name], target)
            assert not neuron.ok
            shape = [f for f in neuron.errors if f.rule == "SCALE-SHAPE"]
            assert len(shape) == 6  # K and V of 3 layers
            assert "the Neuron loader's reshape to [1, 1] crashes" in shape[0].message
            assert "--target gpu --strategy attn_head" in shape[0].hint
            assert "PORT-KV-SCHEME-STRATEGY" in rules(neuron, "error")
            assert "NEURON-QCFG-INPUT-ACT" not in rules(
                neuron
            )  # the platform itself accepts the config


def test_q_scale_on_neuron_is_information(checkpoints):
    report = validate_checkpoint(checkpoints["tensor-q-trn2"], "trn2")
    assert report.ok and not report.warnings, report.findings
    (unused,) = [f for f in report.findings if f.rule == "SCALE-Q-UNUSED"]
    assert unused.severity == "info" and unused.message.startswith(
        "q_scale on 3 layer(s) (FP8 attention): not consumed by the plugin today"
    )
    assert validate_checkpoint(checkpoints["tensor-q-trn2"], "gpu").ok


def _edit_scales(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / SCALES_FILENAME)
    edit(tensors)
    save_file(tensors, ckpt / SCALES_FILENAME, metadata={"format": "pt"})
    sync_index(ckpt)


def test_what_gpu_vllm_cannot_load_is_an_error(checkpoints, tmp_path):
    wrong_heads = copy(checkpoints["per-head-q"], tmp_path / "a")
    _edit_scales(
        wrong_heads,
        lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.ones(3, 1, 1) / 100}),
    )
    errors = validate_checkpoint(wrong_heads, "gpu").errors
    assert [(f.rule, f.location) for f in errors] == [
        ("SCALE-HEADS", f"{SCALES_FILENAME}:model.layers.1.self_attn.k_scale")
    ]
    assert "has shape [3, 1, 1] (3 values) but the model has 2 KV heads" in errors[0].message

    bad_value = copy(checkpoints["per-head-q"], tmp_path / "b")
    _edit_scales(
        bad_value,
        lambda t: t.update({"model.layers.0.self_attn.v_scale": torch.tensor([[[0.01]], [[0.0]]])}),
    )
    (error,) = validate_checkpoint(bad_value, "gpu").errors
    assert error.rule == "SCALE-HEADS" and "head 1 = 0.0" in error.message

    bad_q = copy(checkpoints["per-head-q"], tmp_path / "c")
    _edit_scales(
        bad_q, lambda t: t.update({"model.layers.2.self_attn.q_scale": torch.ones(2, 1, 1)})
    )
    (error,) = validate_checkpoint(bad_q, "gpu").errors
    assert error.rule == "SCALE-Q-SHAPE" and "the model has 4 attention heads" in error.message

    no_q = copy(checkpoints["per-head-q"], tmp_path / "d")
    _edit_scales(no_q, lambda t: t.pop("model.layers.2.self_attn.q_scale"))
    report = validate_checkpoint(no_q, "gpu")
    assert report.ok and "SCALE-Q-MISSING" in rules(report, "warning")


def test_an_attention_group_gpu_vllm_would_not_recognise(checkpoints, tmp_path):
    ckpt = copy(checkpoints["per-head-q"], tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["config_groups"]["attention"]["targets"] = [
        "LlamaAttention",
        "Qwen3Attention",
    ]
    (ckpt / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(ckpt, "gpu")
    assert "PORT-ATTENTION-GROUP" in rules(report, "warning")
    assert "PORT-ATTENTION-GROUP" not in rules(
        validate_checkpoint(checkpoints["per-head-q"], "gpu")
    )
