"""--strategy attn_head and --attention-scales: one scale per KV head (GPU vLLM), Q scales for FP8 attention.

Against oracles that owe nothing to kvcalib (transformers' own KV cache, per KV head; the query the
model hands its own eager attention function), with the scale rounding rule per head, in
llm-compressor's shapes, and bit for bit the same whichever engine observed.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_scale_sized, scale_bits
from oracle import calibration_sequences, oracle_heads
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.cli import app
from kvcalib.core.records import to_json
from kvcalib.core.schema import SCALES_FILENAME, neuron_scale_key
from kvcalib.validation.pipeline import validate_checkpoint

SMALL = dict(num_samples=12, max_seq_len=256)
PER_HEAD = dict(target="gpu", strategy="attn_head", attention_scales=True)


@pytest.mark.parametrize("batch_size", [1, 5])
def test_per_head_and_q_scales_equal_the_oracle(
    batch_size, tiny_llama_master, text_dataset, tmp_path
):
    out = tmp_path / "out"
    result = calibrate(
        tiny_llama_master,
        str(text_dataset),
        out,
        CalibrateOptions(batch_size=batch_size, scale_objective="absmax", **PER_HEAD, **SMALL),
    )  # sized by each head's absmax
    seqs = calibration_sequences(tiny_llama_master, text_dataset, **SMALL)
    _, _, q = oracle_heads(tiny_llama_master, seqs)  # Q from the model's own (eager) attention call
    k, v, _ = oracle_heads(
        tiny_llama_master, seqs, attn_implementation="sdpa"
    )  # the attention kvcalib runs
    scales = load_file(out / SCALES_FILENAME)
    for layer in result.layers:
        i = layer.layer
        for kind, oracle, heads in (("k", k[i], 2), ("v", v[i], 2), ("q", q[i], 4)):
            mine = getattr(layer, kind).head_absmax
            if (
                batch_size == 1 and kind != "q"
            ):  # the very same computation, sample by sample: to the last bit
                assert list(mine) == oracle.tolist(), (i, kind)
            else:  # padded batches (other matmul shapes), or Q after eager layers: the same values, rounded apart
                assert list(mine) == pytest.approx(oracle.tolist(), rel=1e-6), (i, kind)
            tensor = scales[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert tensor.dtype == torch.float32 and tuple(tensor.shape) == (
                heads,
                1,
                1,
            )  # llm-compressor's layout
            assert tensor.reshape(-1).tolist() == list(getattr(layer, kind).head_scales)
            for scale, absmax in zip(tensor.reshape(-1).tolist(), mine):
                assert_scale_sized(scale, absmax, "gpu")
        assert layer.k.absmax == max(layer.k.head_absmax) and layer.k.scale == max(
            layer.k.head_scales
        )
    assert (
        len({tuple(layer.k.head_absmax) for layer in result.layers}) == 3 and k[0][0] != k[0][1]
    ), "heads must differ"


def test_the_checkpoint_is_what_llm_compressor_writes_and_gpu_vllm_reads(
    tiny_llama_master, text_dataset, tmp_path
):
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "out"
    calibrate(
        tiny_llama_master,
        str(text_dataset),
        out,
        CalibrateOptions(**PER_HEAD, num_samples=4, max_seq_len=32),
    )
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = {
        "num_bits": 8,
        "type": "float",
        "strategy": "attn_head",
        "dynamic": False,
        "symmetric": True,
        "observer": "static_minmax",
    }
    assert qc["kv_cache_scheme"] == scheme
    assert qc["config_groups"] == {
        "attention": {
            "targets": ["LlamaAttention"],
            "weights": None,
            "input_activations": scheme,
            "output_activations": None,
        }
    }
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
    assert parsed.config_groups["attention"].input_activations.strategy == "attn_head"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(
        index[f"model.layers.{i}.self_attn.{kind}_scale"] == SCALES_FILENAME
        for i in range(3)
        for kind in "kvq"
    )
    assert validate_checkpoint(out, "gpu").ok
    card = (out / "README.md").read_text()
    assert "Per-KV-head FP8 KV-cache scales" in card and "| q absmax | q_scale |" in card
    assert "--device trn2" not in card, "no Neuron serve command for scales Neuron cannot load"
    # KV only, per tensor: no attention group, no q_scale (what Neuron and GPU read today)
    plain = tmp_path / "plain"
    calibrate(
        tiny_llama_master,
        str(text_dataset),
        plain,
        CalibrateOptions(target="gpu", num_samples=4, max_seq_len=32),
    )
    assert (
        json.loads((plain / "config.json").read_text())["quantization_config"]["config_groups"]
        == {}
    )
    assert all(tuple(t.shape) == (1,) for t in load_file(plain / SCALES_FILENAME).values())
    assert not any(key.endswith("q_scale") for key in load_file(plain / SCALES_FILENAME))


def test_per_tensor_q_scales_for_neuron_are_accepted_and_reported_unused(
    tiny_llama_master, text_dataset, tmp_path
):
    out = tmp_path / "out"
    result = calibrate(
        tiny_llama_master,
        str(text_dataset),
        out,
        CalibrateOptions(target="trn2", attention_scales=True, num_samples=4, max_seq_len=32),
    )
    scales = load_file(out / SCALES_FILENAME)
    assert tuple(scales["model.layers.0.self_attn.q_scale"].shape) == (1,)
    for layer in result.layers:
        assert_scale_sized(layer.q.scale, layer.q.absmax, "trn2")
        assert layer.q.head_absmax is None and layer.k.head_scales is None
    report = validate_checkpoint(out, "trn2")
    assert report.ok, report.errors
    unused = [f for f in report.findings if f.rule == "SCALE-Q-UNUSED"]
    assert len(unused) == 1 and unused[0].severity == "info"
    assert "not consumed by the plugin today" in unused[0].message


def test_streamed_equals_in_memory_per_head_bit_for_bit(tiny_llama_master, text_dataset, tmp_path):
    opts = dict(num_samples=12, max_seq_len=64, batch_size=4, **PER_HEAD)
    memory = calibrate(
        tiny_llama_master, str(text_dataset), tmp_path / "memory", CalibrateOptions(**opts)
    )
    streamed = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "stream",
        CalibrateOptions(engine="stream", **opts),
    )
    assert [to_json(layer) for layer in streamed.layers] == [
        to_json(layer) for layer in memory.layers
    ]
    assert scale_bits(tmp_path / "stream") == scale_bits(tmp_path / "memory")


def test_per_tensor_scales_do_not_change_with_the_new_options(
    tiny_llama_master, text_dataset, tmp_path
):
    """Per-tensor K/V scales are the max over the heads: the same bits with or without per-head or Q observed."""
    opts = dict(num_samples=8, max_seq_len=64, batch_size=4, target="gpu")
    plain = calibrate(
        tiny_llama_master, str(text_dataset), tmp_path / "plain", CalibrateOptions(**opts)
    )
    with_q = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "q",
        CalibrateOptions(attention_scales=True, **opts),
    )
    heads = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "h",
        CalibrateOptions(strategy="attn_head", **opts),
    )
    assert [(layer.k.scale, layer.v.scale) for layer in with_q.layers] == [
        (layer.k.scale, layer.v.scale) for layer in plain.layers
    ]
    assert [(layer.k.absmax, layer.v.absmax) for layer in heads.layers] == [
        (layer.k.absmax, layer.v.absmax) for layer in plain.layers
    ]
    bits = scale_bits(tmp_path / "q")
    assert {k: v for k, v in bits.items() if not k.endswith("q_scale")} == scale_bits(
        tmp_path / "plain"
    )


def test_the_cli_flags(tiny_llama_master, text_dataset, tmp_path):
    runner = CliRunner()
    args = [
        "calibrate",
        str(tiny_llama_master),
        "--dataset",
        str(text_dataset),
        "--num-samples",
        "4",
        "--max-seq-len",
        "32",
    ]
    done = runner.invoke(
        app,
        [
            *args,
            "-o",
            str(tmp_path / "out"),
            "--target",
            "gpu",
            "--strategy",
            "attn_head",
            "--attention-scales",
            "--json",
        ],
    )
    assert done.exit_code == 0, done.stderr
    layers = json.loads(done.stdout)["layers"]
    assert len(layers[0]["k"]["head_scales"]) == 2 and len(layers[0]["q"]["head_scales"]) == 4
    assert "per-head KV scales for gpu" in done.stderr and "q_scale" in done.stderr
    refused = runner.invoke(app, [*args, "-o", str(tmp_path / "no"), "--strategy", "attn_head"])
    assert refused.exit_code == 2 and "Traceback" not in refused.stderr
    assert (
        "error: --strategy attn_head (one scale per KV head) cannot serve on trn2" in refused.stderr
    )
    assert not (tmp_path / "no").exists()
    llmc = runner.invoke(
        app, [*args, "-o", str(tmp_path / "no"), "--attention-scales", "--engine", "llmcompressor"]
    )
    assert (
        llmc.exit_code == 2
        and "--attention-scales observes Q with kvcalib's own engines" in llmc.stderr
    )
    provenance = json.loads((tmp_path / "out" / "kvcalib_calibration.json").read_text())
    assert provenance["strategy"] == "attn_head" and provenance["attention_scales"] is True
    assert provenance["layers"][0]["k"]["head_absmax"] == layers[0]["k"]["head_absmax"]
    assert (
        layers[0]["k"]["key"] == neuron_scale_key(0, "k")
        and "key" not in provenance["layers"][0]["k"]
    )


def test_per_head_scales_are_refused_where_they_cannot_serve(
    tiny_llama_master, text_dataset, tmp_path
):
    """vLLM reads per-head KV scales on FlashAttention (cuda) only: serve-check on cpu or Neuron says so up front."""
    runner = CliRunner()
    calibrated = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(tmp_path / "no"),
            "--target",
            "gpu",
            "--strategy",
            "attn_head",
            "--serve-check",
            "cpu",
        ],
    )
    assert calibrated.exit_code == 2 and "Traceback" not in calibrated.stderr
    assert (
        "error: per-head KV scales (strategy attn_head) cannot serve on --device cpu: vLLM reads per-head KV "
        "scales on its FlashAttention backend only"
    ) in calibrated.stderr
    assert not (tmp_path / "no").exists()
    out = tmp_path / "heads"
    calibrate(
        tiny_llama_master,
        str(text_dataset),
        out,
        CalibrateOptions(**PER_HEAD, num_samples=4, max_seq_len=32),
    )
    served = runner.invoke(app, ["serve-check", str(out), "--device", "cpu"])
    assert served.exit_code == 2 and "Traceback" not in served.stderr, served.stderr
    assert (
        "cannot serve on --device cpu" in served.stderr
        and "its CPU backend refuses them" in served.stderr
    )
    neuron = runner.invoke(
        app, ["serve-check", str(out), "--device", "trn2"]
    )  # validate's verdict comes first
    assert neuron.exit_code == 1 and "Traceback" not in neuron.stderr
    assert (
        "fails validation for trn2: SCALE-SHAPE" in neuron.stderr
        and "reshape to [1, 1] crashes" in neuron.stderr
    )
