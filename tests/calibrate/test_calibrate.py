"""calibrate end to end on a tiny real Llama: the oracle, padding, the checkpoint, the errors."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_scale_sized, write_jsonl
from oracle import calibration_sequences, oracle_absmax, tree_digest  # noqa: E402
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.calibration.writer import WritePlan, write_checkpoint
from kvcalib.core.errors import (
    CalibrationError,
    CheckpointNotFoundError,
    DatasetError,
    KvcalibError,
    OutputExistsError,
    UnknownTargetError,
    UnsupportedModelError,
)
from kvcalib.core.schema import (
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
    neuron_scale_key,
)

SMALL = dict(num_samples=12, max_seq_len=256)


def read_scales(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / SCALES_FILENAME)


def test_scales_equal_absmax_from_transformers_cache(tiny_llama_master, text_dataset, tmp_path):
    out = tmp_path / "out"
    result = calibrate(
        tiny_llama_master,
        str(text_dataset),
        out,
        CalibrateOptions(batch_size=1, scale_objective="absmax", **SMALL),
    )
    seqs = calibration_sequences(tiny_llama_master, text_dataset, **SMALL)
    k, v = oracle_absmax(tiny_llama_master, seqs)
    scales = read_scales(out)
    for i in range(3):
        assert_scale_sized(scales[neuron_scale_key(i, "k")].item(), k[i].item(), "trn2")
        assert_scale_sized(scales[neuron_scale_key(i, "v")].item(), v[i].item(), "trn2")
        assert result.layers[i].k.absmax == k[i].item()
        assert result.layers[i].v.absmax == v[i].item()
    assert result.num_tokens == sum(len(s) for s in seqs)
    assert result.num_samples == len(seqs)


def test_padding_never_reaches_statistics(tiny_llama_master, text_dataset, tmp_path):
    """The same samples in one padded batch and one by one give identical scales."""
    one = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "one",
        CalibrateOptions(batch_size=1, **SMALL),
    )
    batched = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "all",
        CalibrateOptions(batch_size=12, **SMALL),
    )
    lengths = {len(s) for s in calibration_sequences(tiny_llama_master, text_dataset, **SMALL)}
    assert len(lengths) > 1, "the samples must differ in length, or nothing is padded"
    for a, b in zip(one.layers, batched.layers):
        assert a.k.absmax == pytest.approx(b.k.absmax, rel=1e-6, abs=0)
        assert a.v.absmax == pytest.approx(b.v.absmax, rel=1e-6, abs=0)


def test_padding_tokens_would_change_the_result_if_counted(tiny_llama, text_dataset, tmp_path):
    """Guard for the test above: a huge embedding on the pad token must not move any scale."""
    from safetensors.torch import save_file as save

    index = json.loads((tiny_llama / INDEX_FILENAME).read_text())
    shard = tiny_llama / index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(shard)
    config = json.loads((tiny_llama / "config.json").read_text())
    tensors["model.embed_tokens.weight"][config["pad_token_id"]] *= 1000.0
    save(tensors, shard, metadata={"format": "pt"})
    one = calibrate(
        tiny_llama, str(text_dataset), tmp_path / "one", CalibrateOptions(batch_size=1, **SMALL)
    )
    batched = calibrate(
        tiny_llama, str(text_dataset), tmp_path / "all", CalibrateOptions(batch_size=12, **SMALL)
    )
    for a, b in zip(one.layers, batched.layers):
        assert a.v.absmax == pytest.approx(b.v.absmax, rel=1e-6, abs=0)


def test_written_checkpoint(tiny_llama, text_dataset, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    before = tree_digest(tiny_llama)
    out = tmp_path / "out"
    result = calibrate(tiny_llama, str(text_dataset), out, CalibrateOptions(target="trn3", **SMALL))
    assert tree_digest(tiny_llama) == before, "the input checkpoint was modified"

    # weight files byte-identical to the input's
    shards = sorted(p.name for p in tiny_llama.glob("*.safetensors"))
    assert len(shards) > 1
    for name in shards:
        assert filecmp.cmp(tiny_llama / name, out / name, shallow=False), name

    # every layer has both keys, float32, shape [1]; every key is in the index
    index = json.loads((out / INDEX_FILENAME).read_text())
    with safe_open(out / SCALES_FILENAME, framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        provenance = json.loads(f.metadata()["kvcalib"])
        keys = set(f.keys())
    expected = {neuron_scale_key(i, kind) for i in range(3) for kind in "kv"}
    assert keys == expected
    for key in expected:
        assert index["weight_map"][key] == SCALES_FILENAME
    scales = read_scales(out)
    for tensor in scales.values():
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == (1,)
    for name in shards:
        with safe_open(out / name, framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
    total = sum(
        t.numel() * t.element_size()
        for p in out.glob("*.safetensors")
        for t in load_file(p).values()
    )
    assert index["metadata"]["total_size"] == total

    # compressed-tensors parses the quantization_config
    config = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(
        {k: v for k, v in config["quantization_config"].items() if k != "version"}
    )
    assert qc.kv_cache_scheme.num_bits == 8 and qc.kv_cache_scheme.type == "float"
    assert qc.kv_cache_scheme.strategy == "tensor" and qc.kv_cache_scheme.dynamic is False
    assert qc.config_groups == {}

    # provenance, in the file beside config.json and in the scale file
    side = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert side == provenance
    assert side["target"] == "trn3" and side["fp8_max"] == 448.0
    assert [layer["k"]["scale"] for layer in side["layers"]] == [
        layer.k.scale for layer in result.layers
    ]
    for layer in result.layers:
        assert_scale_sized(
            layer.k.scale, layer.k.range, "trn3"
        )  # the range the objective chose (absmax or wider)

    # reloads in transformers with identical weights
    orig = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    new = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, value in orig.items():
        assert torch.equal(value, new[key]), key
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).read_bytes() == (tiny_llama / name).read_bytes()
    assert result.validation is not None and result.validation.ok is True


def test_trn2_scales_are_448_over_240_times_gpu_scales(tiny_llama_master, text_dataset, tmp_path):
    absmax = dict(scale_objective="absmax", **SMALL)  # the sizing rule itself
    trn2 = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "a",
        CalibrateOptions(target="trn2", **absmax),
    )
    gpu = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "b",
        CalibrateOptions(target="gpu", **absmax),
    )
    for a, b in zip(trn2.layers, gpu.layers):
        assert a.k.absmax == b.k.absmax
        assert_scale_sized(a.k.scale, a.k.absmax, "trn2")
        assert_scale_sized(b.k.scale, b.k.absmax, "gpu")
        assert a.k.scale == pytest.approx(b.k.scale * 448 / 240, rel=2**-6)


def test_recalibrating_replaces_scales_and_overwrite(tiny_llama_master, text_dataset, tmp_path):
    first = tmp_path / "first"
    calibrate(tiny_llama_master, str(text_dataset), first, CalibrateOptions(target="gpu", **SMALL))
    second = tmp_path / "second"
    result = calibrate(first, str(text_dataset), second, CalibrateOptions(target="trn2", **SMALL))
    index = json.loads((second / INDEX_FILENAME).read_text())
    assert index["weight_map"][neuron_scale_key(0, "k")] == SCALES_FILENAME
    assert_scale_sized(
        read_scales(second)[neuron_scale_key(0, "k")].item(), result.layers[0].k.range, "trn2"
    )
    assert result.validation.ok
    # --overwrite replaces an existing output whole
    (second / "stray.txt").write_text("old")
    calibrate(
        first, str(text_dataset), second, CalibrateOptions(target="trn3", overwrite=True, **SMALL)
    )
    assert not (second / "stray.txt").exists()
    assert json.loads((second / PROVENANCE_FILENAME).read_text())["target"] == "trn3"


def test_scales_inside_a_weight_shard_are_moved_out(tiny_llama, text_dataset, tmp_path):
    """llm-compressor writes k_scale/v_scale into weight shards; recalibrating must not duplicate keys."""
    index = json.loads((tiny_llama / INDEX_FILENAME).read_text())
    shard_name = index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    shard = tiny_llama / shard_name
    tensors = load_file(shard)
    tensors[neuron_scale_key(0, "k")] = torch.tensor([1.0])
    tensors[neuron_scale_key(0, "v")] = torch.tensor([1.0])
    save_file(tensors, shard, metadata={"format": "pt"})
    for key in (neuron_scale_key(0, "k"), neuron_scale_key(0, "v")):
        index["weight_map"][key] = shard_name
    (tiny_llama / INDEX_FILENAME).write_text(json.dumps(index))

    out = tmp_path / "out"
    result = calibrate(tiny_llama, str(text_dataset), out, CalibrateOptions(**SMALL))
    rewritten = load_file(out / shard_name)
    assert neuron_scale_key(0, "k") not in rewritten
    for key, value in rewritten.items():
        assert torch.equal(value, tensors[key])
    assert any("dropped 2 earlier KV scale" in w for w in result.warnings)
    assert result.validation.ok


def test_zero_absmax_gets_a_floor_and_a_warning(tiny_llama, text_dataset, tmp_path):
    index = json.loads((tiny_llama / INDEX_FILENAME).read_text())
    shard = tiny_llama / index["weight_map"]["model.layers.1.self_attn.v_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.1.self_attn.v_proj.weight"].zero_()
    save_file(tensors, shard, metadata={"format": "pt"})
    result = calibrate(tiny_llama, str(text_dataset), tmp_path / "out", CalibrateOptions(**SMALL))
    assert result.layers[1].v.absmax == 0.0
    assert result.layers[1].v.scale == pytest.approx(1e-8, rel=2**-6)
    assert (
        "layer 1: V was exactly zero on every token; its scale is floored at 1e-08"
        in result.warnings
    )


def test_fp16_overflow_names_the_layer(tiny_llama, text_dataset, tmp_path):
    index = json.loads((tiny_llama / INDEX_FILENAME).read_text())
    shard = tiny_llama / index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.weight"].fill_(3000.0)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        CalibrationError,
        match=r"^layer 0: K absmax is (inf|nan) \(overflow in the calibration dtype\)$",
    ) as exc:
        calibrate(
            tiny_llama,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(dtype="float16", **SMALL),
        )
    assert exc.value.hint == "calibrate with --dtype bfloat16 or --dtype float32"
    assert not (tmp_path / "out").exists()


def test_chat_messages_column_uses_the_chat_template(tiny_llama_master, tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "An answer."},
            ]
        }
        for i in range(5)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    result = calibrate(tiny_llama_master, str(data), tmp_path / "out", CalibrateOptions(**SMALL))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_master)
    rendered = tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert "<|im_start|>user" in rendered
    expected = sum(
        len(
            tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
        for r in rows
    )
    assert result.num_tokens == expected and result.num_samples == 5


@pytest.mark.parametrize("kind", ["txt", "parquet", "csv", "save_to_disk", "directory"])
def test_dataset_formats(kind, tiny_llama_master, tmp_path):
    import datasets

    texts = [
        "The first sample of prose.",
        "A second, longer sample of prose for calibration.",
        "Third.",
    ]
    ds = datasets.Dataset.from_dict({"text": texts})
    if kind == "txt":
        path = tmp_path / "data.txt"
        path.write_text("\n\n".join(texts) + "\n")  # blank lines are no samples
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        ds.to_parquet(str(path))
    elif kind == "csv":
        path = tmp_path / "data.csv"
        ds.to_csv(str(path), index=False)
    elif kind == "save_to_disk":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds}).save_to_disk(str(path))
    else:
        path = tmp_path / "files"
        path.mkdir()
        write_jsonl(path / "a.jsonl", [{"text": t} for t in texts[:2]])
        write_jsonl(path / "b.jsonl", [{"text": texts[2]}])
    result = calibrate(tiny_llama_master, str(path), tmp_path / "out", CalibrateOptions(**SMALL))
    assert result.num_samples == 3


def test_selection_is_first_n_rows_then_shuffled(tiny_llama_master, tmp_path):
    """llm-compressor's selection: split[:N], then shuffle(seed)."""
    import datasets
    from transformers import AutoTokenizer

    from kvcalib.hf.data import load_calibration_data

    texts = [f"row {i} " + "word " * i for i in range(20)]
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in texts])
    tok = AutoTokenizer.from_pretrained(tiny_llama_master)
    data = load_calibration_data(str(path), tok, CalibrateOptions(num_samples=8, max_seq_len=1000))
    expected = datasets.Dataset.from_dict({"text": texts[:8]}).shuffle(seed=42)["text"]
    assert [tok.decode(list(s)) for s in data.sequences] == expected


# --- errors: a clear message, nothing written ---------------------------------------------


def _no_output_left(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], (
        "a temporary directory was left"
    )


def test_error_missing_model_dir(text_dataset, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"^model directory not found: .*/nope$"):
        calibrate(tmp_path / "nope", str(text_dataset), tmp_path / "out")
    _no_output_left(tmp_path, "out")


def test_error_not_a_causal_lm(text_dataset, tmp_path):
    from transformers import BertConfig

    model_dir = tmp_path / "bert"
    BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(model_dir)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model_type 'bert' \(architectures \['BertForMaskedLM'\]\) is not a causal",
    ) as exc:
        calibrate(model_dir, str(text_dataset), tmp_path / "out")
    assert exc.value.hint == "kvcalib calibrates decoder-only LLMs (Llama, Qwen3, Mistral, ...)"
    _no_output_left(tmp_path, "out")


def test_error_weights_that_do_not_match_the_config(tiny_llama, text_dataset, tmp_path):
    """config.json says 5 layers, the shards hold 3: transformers would random-initialise layers 3-4."""
    config = json.loads((tiny_llama / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError,
        match=r"the safetensors weights do not match config.json: \d+ missing "
        r"from the checkpoint \(model\.layers\.3\.",
    ) as exc:
        calibrate(tiny_llama, str(text_dataset), tmp_path / "out", CalibrateOptions(**SMALL))
    assert "random values" in exc.value.hint
    _no_output_left(tmp_path, "out")
    with pytest.raises(
        UnsupportedModelError, match=r"model\.layers\.3\.\S+ is not in the checkpoint's safetensors"
    ):
        calibrate(
            tiny_llama,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(engine="stream", **SMALL),
        )
    _no_output_left(tmp_path, "out")
    config["num_hidden_layers"] = 2  # now the shards hold a layer the model does not have
    (tiny_llama / "config.json").write_text(json.dumps(config))
    for engine in ("native", "stream"):
        with pytest.raises(
            UnsupportedModelError,
            match=r"do not match config.json: \d+ not in the model "
            r"\(model\.layers\.2\.",
        ):
            calibrate(
                tiny_llama,
                str(text_dataset),
                tmp_path / "out",
                CalibrateOptions(engine=engine, **SMALL),
            )
        _no_output_left(tmp_path, "out")


def test_error_already_weight_quantised(tiny_llama, text_dataset, tmp_path):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"the model is already quantised \(quant_method 'fp8'\)"
    ):
        calibrate(tiny_llama, str(text_dataset), tmp_path / "out")


def test_error_empty_dataset(tiny_llama_master, tmp_path):
    empty = tmp_path / "empty.jsonl"
    write_jsonl(empty, [{"text": ""}, {"text": ""}])
    with pytest.raises(DatasetError, match=r"all 2 selected rows of column 'text' are empty"):
        calibrate(tiny_llama_master, str(empty), tmp_path / "out")
    _no_output_left(tmp_path, "out")


def test_error_unknown_text_column(tiny_llama_master, text_dataset, tmp_path):
    with pytest.raises(DatasetError, match=r"has no column 'body'; it has \['text'\]") as exc:
        calibrate(
            tiny_llama_master,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(text_column="body"),
        )
    assert exc.value.hint == "pass one of them with --text-column"
    _no_output_left(tmp_path, "out")


def test_error_dataset_not_found(tiny_llama_master, tmp_path):
    with pytest.raises(DatasetError, match=r"^dataset not found: .*missing\.jsonl$"):
        calibrate(tiny_llama_master, str(tmp_path / "missing.jsonl"), tmp_path / "out")


def test_error_existing_output_without_overwrite(tiny_llama_master, text_dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"^output .*/out already exists$") as exc:
        calibrate(tiny_llama_master, str(text_dataset), out)
    assert exc.value.hint == "choose a new path, or pass --overwrite to replace it"
    assert (out / "keep.txt").read_text() == "mine"


def test_error_output_inside_input(tiny_llama, text_dataset):
    before = tree_digest(tiny_llama)
    with pytest.raises(OutputExistsError, match="overlaps the model checkpoint"):
        calibrate(
            tiny_llama,
            str(text_dataset),
            tiny_llama / "calibrated",
            CalibrateOptions(overwrite=True),
        )
    with pytest.raises(OutputExistsError, match="overlaps the model checkpoint"):
        calibrate(tiny_llama, str(text_dataset), tiny_llama, CalibrateOptions(overwrite=True))
    assert tree_digest(tiny_llama) == before


def test_error_unknown_target(tiny_llama_master, text_dataset, tmp_path):
    with pytest.raises(
        UnknownTargetError, match=r"^unknown target 'trn9'; known targets: gpu, trn2, trn3$"
    ):
        calibrate(
            tiny_llama_master, str(text_dataset), tmp_path / "out", CalibrateOptions(target="trn9")
        )
    _no_output_left(tmp_path, "out")


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, RuntimeError])
def test_interrupted_write_leaves_nothing(tiny_llama_master, tmp_path, exc_type):
    def boom(_tmp: Path) -> None:
        raise exc_type("interrupted")

    plan = WritePlan(
        scales={neuron_scale_key(0, "k"): torch.tensor([0.1])},
        quantization_config={},
        provenance={},
    )
    with pytest.raises(exc_type):
        write_checkpoint(tiny_llama_master, tmp_path / "out", plan, check=boom)
    _no_output_left(tmp_path, "out")


def test_errors_are_kvcalib_errors():
    for cls in (
        CheckpointNotFoundError,
        DatasetError,
        OutputExistsError,
        UnknownTargetError,
        CalibrationError,
    ):
        assert issubclass(cls, KvcalibError)
