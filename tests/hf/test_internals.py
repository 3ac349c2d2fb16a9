"""kvcalib.hf.internals, the one door to transformers' private internals: on the installed release each resolves
and does what kvcalib uses it for; where one is missing or its parameters changed (a release outside the tested
range), the command refuses with one line naming the release, the tested range and what to install, and writes
nothing."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.hf import internals
from kvcalib.hf.model import load_model


def test_every_internal_resolves_on_the_installed_release(tiny_llama):
    """What each accessor returns on this release (CI: 5.17.0 and 5.25.0)."""
    from transformers.models.llama import modeling_llama

    assert internals.causal_lm_names()["llama"] == "LlamaForCausalLM"
    eager = internals.eager_attention(modeling_llama.LlamaAttention)
    assert eager is modeling_llama.eager_attention_forward
    assert type(internals.mxfp4_quantizer()).__name__ == "Mxfp4HfQuantizer"
    table = internals.mxfp4_table(
        torch.bfloat16
    )  # byte 0x21 (codes 1 and 2: 0.5, 1.0) at exponent 127: x1
    assert table.shape == (512, 256) and table[0x42:0x44, 127].tolist() == [0.5, 1.0]
    model = load_model(tiny_llama, torch.float32, torch.device("cpu"), False)
    key = "model.layers.0.self_attn.k_proj.weight"
    assert internals.renamer(model, None, dict(model.state_dict()))(key) == key
    assert set(internals.cache_kwargs(model, None)) <= {"cache", "past_key_values"}


def _drop(monkeypatch, module: str, name: str) -> None:
    monkeypatch.delattr(importlib.import_module(f"transformers.{module}"), name)


def _narrow(monkeypatch, module: str, name: str) -> None:
    monkeypatch.setattr(importlib.import_module(f"transformers.{module}"), name, lambda model: [])


@pytest.mark.parametrize(
    "change, module, name, flags, what",
    [
        (_drop, "core_model_loading", "rename_source_key", ["--stream-layers"], "is missing"),
        (
            _narrow,
            "conversion_mapping",
            "get_model_conversion_mapping",
            ["--stream-layers"],
            "no longer takes hf_quantizer",
        ),
        (_drop, "models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", [], "is missing"),
        # MXFP4 experts, in memory and streamed: inside a load transformers records errors, not raising them
        (_drop, "integrations.mxfp4", "_convert_moe_packed_tensors", ["mxfp4"], "is missing"),
        (
            _drop,
            "integrations.mxfp4",
            "_convert_moe_packed_tensors",
            ["mxfp4", "--stream-layers"],
            "is missing",
        ),
        # GPT-OSS runs eager attention: Q is observed around its modeling file's own function
        (
            _narrow,
            "models.gpt_oss.modeling_gpt_oss",
            "eager_attention_forward",
            ["mxfp4", "--attention-scales"],
            "no longer takes module, query, key, value, attention_mask",
        ),
    ],
)
def test_a_changed_internal_is_refused_in_one_line(
    change, module, name, flags, what, tiny_llama, short_dataset, tmp_path, monkeypatch
):
    from mxfp4 import build_gpt_oss_mxfp4

    model = tiny_llama
    if flags[:1] == ["mxfp4"]:
        model, flags = build_gpt_oss_mxfp4(tmp_path / "gpt-oss", layers=2), flags[1:]
    change(monkeypatch, module, name)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["calibrate", str(model), "--dataset", str(short_dataset), "-o", str(out)]
        + ["--num-samples", "2", "--max-seq-len", "16", *flags],
    )
    assert result.exit_code == 1, result.output
    *_progress, refusal = result.stderr.strip().splitlines()
    assert result.stderr.count("error:") == 1
    assert refusal == (
        f"error: transformers {transformers.__version__}: transformers.{module}.{name}, which kvcalib "
        f"uses, {what} (kvcalib is tested with transformers 5.17 to 5.25): "
        "pip install 'transformers>=5.17,<5.26'"
    )
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert not out.exists()


def test_a_conversion_that_fails_while_streaming_is_named(short_dataset, tmp_path, monkeypatch):
    """transformers records what a conversion raises and loads on without the weight: the stream engine says
    which weight, and why, instead of reporting it missing from the checkpoint."""
    from mxfp4 import build_gpt_oss_mxfp4

    from kvcalib.hf import mxfp4

    def broken(blocks, scales, **kwargs):
        raise ValueError("a conversion that fails")

    monkeypatch.setattr(mxfp4, "dequantize", broken)
    model = build_gpt_oss_mxfp4(tmp_path / "gpt-oss", layers=2)
    result = CliRunner().invoke(
        app,
        ["calibrate", str(model), "--dataset", str(short_dataset), "-o", str(tmp_path / "out")]
        + ["--num-samples", "2", "--max-seq-len", "16", "--stream-layers"],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        "error: transformers could not convert the checkpoint's tensors for model.layers.0.mlp.experts."
        in (result.stderr)
    )
    assert "gate_up_proj: ValueError: a conversion that fails\n" in result.stderr
