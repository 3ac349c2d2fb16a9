"""eval on per-head KV scales and FP8 attention: side by side with per-tensor, by construction where it can be."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import sync_index
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.cli import app
from kvcalib.core import fp8
from kvcalib.core.errors import UsageError
from kvcalib.core.schema import SCALES_FILENAME
from kvcalib.evaluation.emulate import KVQuantizer
from kvcalib.evaluation.pipeline import EvalOptions, evaluate

DATA = dict(num_samples=6, max_seq_len=96)


@pytest.fixture(scope="module")
def checkpoints(calibrate_tiny) -> dict[str, Path]:
    return {
        name: calibrate_tiny(**options)
        for name, options in {
            "tensor": dict(target="gpu", attention_scales=True),
            "head": dict(target="gpu", strategy="attn_head", attention_scales=True),
            "tensor-trn3": dict(target="trn3", attention_scales=True),
        }.items()
    }


def edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / SCALES_FILENAME)
    edit(tensors)
    save_file(tensors, dst / SCALES_FILENAME, metadata={"format": "pt"})
    sync_index(dst)
    return dst


def test_per_head_with_equal_heads_is_per_tensor_to_the_bit(checkpoints, text_dataset, tmp_path):
    """Per-head scales that all equal the per-tensor one must give exactly the per-tensor run: the same numerics."""
    tensor = load_file(checkpoints["tensor"] / SCALES_FILENAME)
    same = edited(
        checkpoints["head"],
        tmp_path / "same",
        lambda t: t.update(
            {k: tensor[k].reshape(1, 1, 1).expand(v.shape).contiguous() for k, v in t.items()}
        ),
    )
    result = evaluate(
        checkpoints["tensor"],
        str(text_dataset),
        EvalOptions(target="gpu", compare=(str(same),), **DATA),
    )
    plain, heads = result.runs
    assert (plain.kind, heads.kind) == ("KV per-tensor", "KV per-head")
    assert (heads.nll, heads.kl, heads.top1) == (plain.nll, plain.kl, plain.top1)
    assert [layer.k.sqnr_db for layer in heads.layers] == [
        layer.k.sqnr_db for layer in plain.layers
    ]


def test_compare_per_head_and_per_tensor_with_fp8_attention(checkpoints, text_dataset, tmp_path):
    plot = tmp_path / "eval.png"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(checkpoints["tensor"]),
            "--dataset",
            str(text_dataset),
            "--target",
            "gpu",
            "--compare",
            str(checkpoints["head"]),
            "--compare",
            "unit",
            "--fp8-attention",
            "--num-samples",
            "6",
            "--max-seq-len",
            "96",
            "--json",
            "--plot",
            str(plot),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.stderr
    runs = {r["name"]: r for r in json.loads(result.stdout)["runs"]}
    head = str(checkpoints["head"])
    assert {name: r["kind"] for name, r in runs.items()} == {
        "checkpoint": "KV per-tensor",
        head: "KV per-head",
        "unit": "KV per-tensor",
        "checkpoint +fp8-attn": "FP8 attn, per-tensor",
        f"{head} +fp8-attn": "FP8 attn, per-head",
    }
    for name, run in runs.items():
        assert all(math.isfinite(run[m]) for m in ("delta_nll", "kl", "top1")), name
        has_q = "q_sqnr_db" in run["layers"][0]
        assert has_q == name.endswith("+fp8-attn")
        if has_q:  # E4M3 keeps 3 mantissa bits: about 30 dB on Q, far below on nothing
            assert all(25 < layer["q_sqnr_db"] < 40 for layer in run["layers"]), run["layers"]
    assert runs["checkpoint +fp8-attn"]["nll"] != runs["checkpoint"]["nll"], (
        "Q in FP8 must change something"
    )
    assert plot.stat().st_size > 10_000
    assert "FP8 attn, per-head" in result.stderr and "Q SQNR" in result.stderr


def test_q_scales_are_really_applied(checkpoints, text_dataset, tmp_path):
    """The canary for Q: q_scale / 64 saturates Q on every layer and must cost far more than the calibrated one."""
    small = edited(
        checkpoints["tensor"],
        tmp_path / "small",
        lambda t: t.update({k: v / 64 for k, v in t.items() if k.endswith("q_scale")}),
    )
    result = evaluate(
        checkpoints["tensor"],
        str(text_dataset),
        EvalOptions(target="gpu", compare=(str(small),), fp8_attention=True, **DATA),
    )
    runs = {r.name: r for r in result.runs}
    calibrated, crushed = runs["checkpoint +fp8-attn"], runs[f"{small} +fp8-attn"]
    assert runs[str(small)].nll == runs["checkpoint"].nll  # KV only: q_scale is not read
    assert crushed.kl > 20 * calibrated.kl
    assert all(layer.q.clipped > 0.5 for layer in crushed.layers)
    assert all(
        layer.q.clipped < 0.01 for layer in calibrated.layers
    )  # held-out text may pass the calibrated absmax


@pytest.mark.parametrize("target", ["gpu", "trn3"])
def test_fp8_attention_is_the_attention_of_fp8_values_in_float32(target):
    """One attention call through KVQuantizer.attend equals the formula in float64, within float32's rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 16) * 3 for _ in range(3))
    t = fp8.TARGETS[target]
    q_scale, k_scale, v_scale = (float(x.abs().max()) / t.fp8_max for x in (q, k, v))
    quantizer = KVQuantizer([k_scale], [v_scale], t, q_scales=[q_scale], fp8_attention=True)
    module = torch.nn.Module()
    module.layer_idx, module.num_key_value_groups, module.is_causal, module.training = (
        0,
        1,
        True,
        False,
    )
    k_hat, v_hat = quantizer.observe(0, k, v)
    out, _ = quantizer.attend(
        sdpa_attention_forward, module, q, k_hat, v_hat, None, scaling=0.25, dropout=0.0
    )
    qd, kd, vd = (
        fp8.fake_quantize(x.double(), s, t) for x, s in ((q, q_scale), (k, k_scale), (v, v_scale))
    )
    logits = qd @ kd.transpose(-1, -2) * 0.25 + torch.full((7, 7), float("-inf")).triu(1).double()
    expected = (torch.softmax(logits, -1) @ vd).transpose(1, 2)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
    plain, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, dropout=0.0)
    assert not torch.allclose(out, plain, rtol=1e-3, atol=1e-4), "and Q, K, V really were quantised"


def test_what_eval_refuses(checkpoints, text_dataset, tmp_path):
    with pytest.raises(UsageError) as exc:
        evaluate(checkpoints["head"], str(text_dataset), EvalOptions(target="trn2", **DATA))
    assert (
        "per-head KV scales, which trn2 cannot serve" in exc.value.message
        and "--target gpu" in exc.value.hint
    )
    no_q = edited(
        checkpoints["tensor"],
        tmp_path / "no-q",
        lambda t: [t.pop(k) for k in list(t) if k.endswith("q_scale")],
    )
    with pytest.raises(
        UsageError, match="--fp8-attention needs q_scale, and no checkpoint evaluated has one"
    ):
        evaluate(
            no_q,
            str(text_dataset),
            EvalOptions(target="gpu", compare=("unit",), fp8_attention=True, **DATA),
        )
    partial = edited(
        checkpoints["tensor"],
        tmp_path / "partial",
        lambda t: t.pop("model.layers.1.self_attn.q_scale"),
    )
    with pytest.raises(UsageError, match="q_scale on 1 of 3 layers"):
        evaluate(partial, str(text_dataset), EvalOptions(target="gpu", **DATA))


def test_per_head_scales_are_blind_to_one_outlier_head(tiny_llama_master, text_dataset, tmp_path):
    """KV head 0's K x4096 (its queries / 4096): the same model to the bit. Per-head scales follow the head
    exactly (x4096, a power of two), so the per-head FP8 run is the original's to the bit; one per-tensor scale
    now leaves head 1 with 1/4096 of the FP8 range (among E4M3's subnormals), and its run changes."""
    import subprocess
    import sys

    from helpers import SCRIPTS
    from transformers import AutoModelForCausalLM

    variant = tmp_path / "head-outlier"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "make_outlier_model.py"),
            str(tiny_llama_master),
            str(variant),
            "--factor",
            "4096",
            "--head",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    ids = torch.tensor([list(range(5, 60))])
    with torch.inference_mode():
        before, after = (
            AutoModelForCausalLM.from_pretrained(m).eval()(input_ids=ids).logits
            for m in (tiny_llama_master, variant)
        )
    assert torch.equal(before, after), (
        "scaling one head's K by a power of two (and its Q back) changes nothing"
    )
    # absmax scales: the objective's 1.0 candidate is the one scale that does not follow a head x4096
    opts = dict(target="gpu", num_samples=8, max_seq_len=64, scale_objective="absmax")
    runs = {}
    for name, model in (("original", tiny_llama_master), ("variant", variant)):
        for strategy in ("tensor", "attn_head"):
            out = tmp_path / f"{name}-{strategy}"
            calibrated = calibrate(
                model, str(text_dataset), out, CalibrateOptions(strategy=strategy, **opts)
            )
            runs[name, strategy] = (
                calibrated,
                evaluate(out, str(text_dataset), EvalOptions(target="gpu", **DATA)).runs[0],
            )
    original, variant_heads = runs["original", "attn_head"][0], runs["variant", "attn_head"][0]
    for a, b in zip(original.layers, variant_heads.layers):
        assert b.k.head_scales == (a.k.head_scales[0] * 4096, a.k.head_scales[1])
    same, other = runs["original", "attn_head"][1], runs["variant", "attn_head"][1]
    assert (other.nll, other.kl, other.top1) == (same.nll, same.kl, same.top1)
    plain, skewed = runs["original", "tensor"][1], runs["variant", "tensor"][1]
    assert (skewed.nll, skewed.kl) != (plain.nll, plain.kl)
