"""Property tests: validate never raises on anything a checkpoint can hold, and its
quantization-config verdict is the platform's, case for case."""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from checkpoints import neuron_platform
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcalib.core.records import to_json
from kvcalib.core.schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
)
from kvcalib.validation.config import neuron_quantization_verdict
from kvcalib.validation.pipeline import validate_checkpoint

REAL_KEYS = [
    "quant_method",
    "config_groups",
    "weights",
    "input_activations",
    "output_activations",
    "targets",
    "kv_cache_scheme",
    "group_0",
    "num_bits",
    "type",
    "strategy",
    "dynamic",
    "symmetric",
    "observer",
    "layer",
    "k_scale",
    "v_scale",
    "k_absmax",
    "fp8_max",
    "target",
    "layers",
    "weight_map",
    "metadata",
    "total_size",
    "dtype",
    "shape",
    "data_offsets",
]
REAL_STRINGS = [
    "compressed-tensors",
    "Compressed_Tensors",
    "COMPRESSED-TENSORS",
    "fp8",
    "modelopt",
    "mxfp4",
    "MXFP8",
    "gpt_oss_mxfp4",
    "LlamaAttention",
    "re:.*self_attn$",
    "re:.*Attention$",
    "Attention",
    "Linear",
    "tensor",
    "channel",
    "attn_head",
    "float",
    "int",
    "static_minmax",
    "trn2",
    "gpu",
    "F32",
    "BF16",
    SCALES_FILENAME,
    "model-00001-of-00012.safetensors",
    "../x.safetensors",
    "model.layers.0.self_attn.k_scale",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(REAL_STRINGS)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(REAL_KEYS) | st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=24,
)
# Shaped like a real quantization_config, with arbitrary values where it counts; a third of
# the examples are compressed-tensors configs with groups, where the platform's branches are.
ct_methods = st.sampled_from(["compressed-tensors", "Compressed_Tensors", "COMPRESSED-TENSORS"])
targets = (
    json_values
    | scalars
    | st.lists(st.sampled_from(REAL_STRINGS) | scalars | json_values, max_size=3)
)
group_objects = st.fixed_dictionaries(
    {},
    optional={
        "weights": json_values,
        "input_activations": json_values,
        "output_activations": json_values,
        "targets": targets,
    },
)
groups = st.dictionaries(
    st.sampled_from(["group_0", "group_1", "g"]), json_values | group_objects, max_size=3
)
kv_cache_schemes = json_values | st.fixed_dictionaries(
    {},
    optional={
        k: json_values | st.sampled_from(REAL_STRINGS) | st.integers(0, 16)
        for k in ("num_bits", "type", "strategy", "dynamic", "symmetric", "observer")
    },
)
quantization_configs = (
    json_values
    | st.fixed_dictionaries(
        {},
        optional={
            "quant_method": ct_methods | st.sampled_from(REAL_STRINGS) | json_values,
            "config_groups": groups | json_values,
            "kv_cache_scheme": kv_cache_schemes,
        },
    )
    | st.fixed_dictionaries(
        {
            "quant_method": ct_methods,
            "config_groups": st.dictionaries(
                st.sampled_from(["group_0", "group_1", "g"]),
                st.fixed_dictionaries(
                    {"input_activations": st.just({"num_bits": 8}) | json_values},
                    optional={
                        "weights": st.none() | json_values,
                        "output_activations": st.none() | json_values,
                        "targets": targets,
                    },
                )
                | json_values,
                min_size=1,
                max_size=3,
            ),
        },
        optional={"kv_cache_scheme": kv_cache_schemes},
    )
)
neuron_configs = st.none() | st.just({"quantization": "mxfp8"}) | json_values


def platform_oracle(quantization_config: Any, neuron_config: Any) -> None:
    """vLLM's normalisation, then the Neuron platform's validator, as their source reads."""
    quant_cfg = copy.deepcopy(quantization_config)
    if quant_cfg is not None:  # vLLM's ModelConfig
        quant_method = quant_cfg.get("quant_method", "").lower()
        quant_method = quant_method.replace("compressed_tensors", "compressed-tensors")
        quant_cfg["quant_method"] = quant_method
    neuron_platform(quant_cfg, neuron_config)


@settings(max_examples=500, deadline=None)
@given(qc=quantization_configs, neuron_config=neuron_configs)
def test_verdict_is_the_platforms(qc: Any, neuron_config: Any) -> None:
    verdict = neuron_quantization_verdict(qc, neuron_config)
    try:
        platform_oracle(qc, neuron_config)
    except ValueError as rejection:
        assert verdict is not None and verdict.rule != "NEURON-QCFG-MALFORMED"
        assert verdict.message.startswith(str(rejection))
    except (AttributeError, TypeError):  # the platform (or vLLM before it) crashes
        assert verdict is not None and verdict.rule == "NEURON-QCFG-MALFORMED"
    else:
        assert verdict is None
    assert verdict is None or verdict.severity == "error"


@pytest.fixture
def workdir(handmade_master: Path, tmp_path: Path) -> Path:
    """One calibrated checkpoint reused by every example (each example restores it first)."""
    return shutil.copytree(handmade_master, tmp_path / "ckpt")


def _never_raises(ckpt: Path, target: str, neuron_config: Any = None) -> dict:
    report = validate_checkpoint(ckpt, target, neuron_config=neuron_config)
    return json.loads(json.dumps(to_json(report)))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    qc=quantization_configs,
    neuron_config=neuron_configs,
    target=st.sampled_from(["trn2", "trn3", "gpu"]),
)
def test_any_quantization_config_gives_findings_not_tracebacks(
    workdir: Path, qc, neuron_config, target
) -> None:
    config = json.loads((workdir / CONFIG_FILENAME).read_text())
    config["quantization_config"] = qc
    (workdir / CONFIG_FILENAME).write_text(json.dumps(config))
    report = _never_raises(workdir, target, neuron_config)
    reread = json.loads(json.dumps(qc))  # what validate read back (NaN != NaN otherwise)
    verdict = neuron_quantization_verdict(reread, neuron_config)
    platform = [f for f in report["findings"] if f["rule"].startswith("NEURON-QCFG-")]
    assert platform == ([to_json(verdict)] if verdict else [])


tensor_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(
            ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F8_E8M0", "F64"]
        )
        | json_values,
        "shape": st.lists(st.integers(0, 3), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(0, 64), min_size=2, max_size=2) | json_values,
    }
)
scale_headers = st.dictionaries(
    st.sampled_from(
        [f"model.layers.{i}.self_attn.{k}_scale" for i in range(4) for k in "kv"]
        + ["model.layers.0.self_attn.kv_scale", "__metadata__"]
    ),
    tensor_entries | json_values,
    max_size=6,
)
elsewhere = st.fixed_dictionaries(
    {},
    optional={
        "num_hidden_layers": json_values | st.integers(-2, 6),
        "text_config": json_values,
        "architectures": json_values
        | st.lists(st.sampled_from(["LlamaForCausalLM", "MistralForCausalLM"])),
        "model_type": json_values,
        "compression_config": json_values,
        "provenance": json_values,
        "index": json_values,
        "weight_map": json_values,
        "scale_metadata": json_values,
        "scale_header": st.tuples(scale_headers, st.binary(max_size=64)),
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=elsewhere, target=st.sampled_from(["trn2", "trn3", "gpu"]))
def test_any_config_index_provenance_or_header_gives_findings_not_tracebacks(
    workdir: Path, changes, target
) -> None:
    pristine = workdir.parent / "pristine"
    if not pristine.exists():
        shutil.copytree(workdir, pristine)
    for name in (CONFIG_FILENAME, INDEX_FILENAME, PROVENANCE_FILENAME, SCALES_FILENAME):
        shutil.copyfile(pristine / name, workdir / name)
    config = json.loads((workdir / CONFIG_FILENAME).read_text())
    for key in (
        "num_hidden_layers",
        "text_config",
        "architectures",
        "model_type",
        "compression_config",
    ):
        if key in changes:
            config[key] = changes[key]
    (workdir / CONFIG_FILENAME).write_text(json.dumps(config))
    if "provenance" in changes:
        (workdir / PROVENANCE_FILENAME).write_text(json.dumps(changes["provenance"]))
    if "index" in changes or "weight_map" in changes:
        index = json.loads((workdir / INDEX_FILENAME).read_text())
        index = changes.get("index", index)
        if "weight_map" in changes and isinstance(index, dict):
            index["weight_map"] = changes["weight_map"]
        (workdir / INDEX_FILENAME).write_text(json.dumps(index))
    if "scale_metadata" in changes:
        _rewrite_header(
            workdir / SCALES_FILENAME,
            lambda h: h.__setitem__(
                "__metadata__", {"format": "pt", "kvcalib": json.dumps(changes["scale_metadata"])}
            ),
        )
    if "scale_header" in changes:
        header, data = changes["scale_header"]
        raw = json.dumps(header).encode()
        (workdir / SCALES_FILENAME).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    _never_raises(workdir, target)


def _rewrite_header(path: Path, edit) -> None:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + length :])


def test_oracle_is_not_vacuous() -> None:
    """The oracle rejects and crashes where the platform does, so the property above can fail."""
    with pytest.raises(ValueError):
        platform_oracle(
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": 1}}}, None
        )
    with pytest.raises(AttributeError):
        platform_oracle({"quant_method": "compressed-tensors", "config_groups": None}, None)
    with pytest.raises(TypeError):
        platform_oracle(
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"input_activations": 1, "targets": [math.pi]}},
            },
            None,
        )
    assert platform_oracle({"quant_method": "mxfp4"}, {"quantization": "mxfp8"}) is None
