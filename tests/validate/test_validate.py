"""kvcalib validate: every rule, on real checkpoint directories built from the tiny Llama."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import PREFIX, make_calibrated, sync_index
from checkpoints import read_json as _read
from checkpoints import write_json as _write
from safetensors.torch import load_file, save_file

from kvcalib.calibration.writer import WritePlan, write_checkpoint
from kvcalib.core.checkpoint import read_json, read_safetensors_header
from kvcalib.core.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    UnknownTargetError,
)
from kvcalib.core.records import to_json
from kvcalib.core.schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
    kv_only_quantization_config,
    neuron_scale_key,
)
from kvcalib.validation.config import neuron_quantization_verdict
from kvcalib.validation.pipeline import validate_checkpoint
from kvcalib.validation.report import ValidationReport
from kvcalib.validation.rules import RULE

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a header above 100 MB
REFUSED = "safetensors refuses the file"  # its own words vary by version

# --- building calibrated checkpoints ------------------------------------------------------

K0 = neuron_scale_key(0, "k")
V1 = neuron_scale_key(1, "v")


def shard_renamed_to_single_file(ckpt: Path) -> None:
    """One shard becomes model.safetensors: transformers then ignores the index (and the scales)."""
    first = sorted(ckpt.glob("model-*.safetensors"))[0]
    first.rename(ckpt / "model.safetensors")
    sync_index(ckpt)


@pytest.fixture
def calibrated(handmade_master: Path, tmp_path: Path) -> Path:
    """Here: a private copy of conftest's hand-made checkpoint (known scales), which every rule's case may change."""
    return shutil.copytree(handmade_master, tmp_path / "ckpt")


# --- mutations ----------------------------------------------------------------------------

Mutation = Callable[[Path], None]
DELETE = object()


def edit_config(fn: Callable[[dict], None]) -> Mutation:
    def mutate(ckpt: Path) -> None:
        config = _read(ckpt / CONFIG_FILENAME)
        fn(config)
        _write(ckpt / CONFIG_FILENAME, config)

    return mutate


def set_qc(path: str, value: Any) -> Mutation:
    """Set (or DELETE) quantization_config[...path...]; "" is quantization_config itself."""

    def fn(config: dict) -> None:
        holder, keys = config, ["quantization_config", *filter(None, path.split("."))]
        for key in keys[:-1]:
            holder = holder[key]
        if value is DELETE:
            del holder[keys[-1]]
        else:
            holder[keys[-1]] = value

    return edit_config(fn)


def edit_scales(fn: Callable[[dict], dict | None], *, metadata: bool = True) -> Mutation:
    """Rewrite kv_scales.safetensors through `fn`, keeping the index consistent."""

    def mutate(ckpt: Path) -> None:
        path = ckpt / SCALES_FILENAME
        provenance = read_safetensors_header(path).metadata["kvcalib"]
        tensors = load_file(path)
        tensors = fn(tensors) or tensors
        meta = {"format": "pt", "kvcalib": provenance} if metadata else {"format": "pt"}
        save_file(tensors, path, metadata=meta)
        sync_index(ckpt)

    return mutate


def set_scale(key: str, value: torch.Tensor) -> Mutation:
    return edit_scales(lambda t: t.__setitem__(key, value))


def set_all_scales(value: float) -> Mutation:
    return edit_scales(lambda t: {k: torch.tensor([value]) for k in t})


def rename_scales(old: str, new: str) -> Mutation:
    return edit_scales(lambda t: {k.replace(old, new): v for k, v in t.items()})


def edit_index(fn: Callable[[dict], None]) -> Mutation:
    def mutate(ckpt: Path) -> None:
        index = _read(ckpt / INDEX_FILENAME)
        fn(index)
        _write(ckpt / INDEX_FILENAME, index)

    return mutate


def edit_provenance(fn: Callable[[dict], None]) -> Mutation:
    def mutate(ckpt: Path) -> None:
        provenance = _read(ckpt / PROVENANCE_FILENAME)
        fn(provenance)
        _write(ckpt / PROVENANCE_FILENAME, provenance)

    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(ckpt: Path) -> None:
        for m in mutations:
            m(ckpt)

    return mutate


def unlink(name: str) -> Mutation:
    return lambda ckpt: (ckpt / name).unlink()


def write_bytes(name: str, data: bytes) -> Mutation:
    return lambda ckpt: (ckpt / name).write_bytes(data)


def move_scales_into_subdir(ckpt: Path) -> None:
    (ckpt / "scales").mkdir()
    (ckpt / SCALES_FILENAME).rename(ckpt / "scales" / SCALES_FILENAME)
    edit_index(
        lambda ix: ix["weight_map"].update(
            {
                k: f"scales/{SCALES_FILENAME}"
                for k, v in ix["weight_map"].items()
                if v == SCALES_FILENAME
            }
        )
    )(ckpt)


def add_extra_file(tensors: dict[str, torch.Tensor], name: str = "extra.safetensors") -> Mutation:
    """A second top-level file that is NOT added to the index."""
    return lambda ckpt: save_file(tensors, ckpt / name, metadata={"format": "pt"})


def strip_scales_metadata_and_file(ckpt: Path) -> None:
    edit_scales(lambda t: None, metadata=False)(ckpt)
    (ckpt / PROVENANCE_FILENAME).unlink()


def drop_kvcalib_files(ckpt: Path) -> None:
    """Back to the plain tiny Llama: no scales, no quantization_config, no provenance."""
    (ckpt / SCALES_FILENAME).unlink()
    (ckpt / PROVENANCE_FILENAME).unlink()
    sync_index(ckpt)
    set_qc("", DELETE)(ckpt)


# --- the table ----------------------------------------------------------------------------

E, W, INFO = "error", "warning", "info"


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Mutation | None
    expected: tuple[tuple[str, str, str | None], ...]  # (rule, severity, exact message or None)
    target: str = "trn2"


def case(
    name: str, mutate: Mutation | None, *expected: tuple[str, str, str | None], target: str = "trn2"
) -> Case:
    return Case(name, mutate, expected, target)


FOREIGN_K0 = (
    "SCALE-FOREIGN-NAME",
    E,
    "found model.layers.0.self_attn.k_proj.output_scale but Neuron reads only "
    "model.layers.0.self_attn.k_scale: layer 0's K cache runs with scale 1.0 on Neuron (no error, no log line)",
)
RANGE_448_ON_TRN2 = (
    "RANGE-TARGET-MISMATCH",
    E,
    "scales were sized for FP8 max 448 (calibrated for gpu), but trn2 saturates at 240: "
    "values above 240/448 ≈ 0.54 of each layer's absmax clip",
)
as_gpu_calibration = edit_provenance(lambda p: p.update(fp8_max=448.0, target="gpu"))


def calibrated_for_gpu(ckpt: Path) -> None:
    make_calibrated(ckpt, fp8_max=448.0, target="gpu")


def clipped_layer_0(scored_on: list[str] | None) -> Mutation:
    """Layer 0's K scale sized for half its absmax (a clip of the scale objective), the provenance saying so, and
    which numerics it was scored on (None: not recorded, as before kvcalib recorded it)."""
    scale = float(torch.tensor([5.0 / 240], dtype=torch.float32))

    def provenance(p: dict) -> None:
        p["layers"][0]["k"].update(absmax=10.0, range=5.0, scale=scale)
        p.pop("scored_on", None)
        if scored_on is not None:
            p["scored_on"] = scored_on

    return both(set_scale(K0, torch.tensor([scale])), edit_provenance(provenance))


def flat_provenance(p: dict) -> None:
    """Each layer as kvcalib 0.1.0 wrote it: k_absmax, k_scale, k_range beside "layer"."""
    p["layers"] = [
        {
            "layer": e["layer"],
            **{f"{k}_{name}": value for k in "kv" for name, value in e[k].items()},
        }
        for e in p["layers"]
    ]


CASES = [
    case("calibrated checkpoint is clean", None),
    case(
        "trn2 checkpoint on trn3: safe, says so, and which KV path uses the scales",
        None,
        ("PORT-TRN3-KV-PATH", INFO, None),
        ("RANGE-TARGET-MISMATCH", INFO, None),
        target="trn3",
    ),
    # rule 2: the Llama gate
    case(
        "llama with fp8 fails at model build",
        set_qc("quant_method", "fp8"),
        (
            "NEURON-LLAMA-QUANT-METHOD",
            E,
            "Unsupported quantization_config.quant_method='fp8'. "
            "Llama3 currently supports: 'modelopt', 'compressed-tensors'.",
        ),
    ),
    case(
        "llama with gptq",
        set_qc("quant_method", "GPTQ"),
        (
            "NEURON-LLAMA-QUANT-METHOD",
            E,
            "Unsupported quantization_config.quant_method='gptq'. "
            "Llama3 currently supports: 'modelopt', 'compressed-tensors'.",
        ),
    ),
    case(
        "llama without quant_method",
        set_qc("quant_method", DELETE),
        (
            "NEURON-LLAMA-QUANT-METHOD",
            E,
            "Unsupported quantization_config.quant_method=''. "
            "Llama3 currently supports: 'modelopt', 'compressed-tensors'.",
        ),
    ),
    case("llama with modelopt passes the gate", set_qc("quant_method", "modelopt")),
    case(
        "model_type llama is a llama",
        both(
            set_qc("quant_method", "fp8"), edit_config(lambda c: c.update(architectures=["Custom"]))
        ),
        ("NEURON-LLAMA-QUANT-METHOD", E, None),
    ),
    case(
        "qwen3 has no llama gate",
        both(
            set_qc("quant_method", "fp8"),
            edit_config(lambda c: c.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")),
        ),
    ),
    case(
        "mx is refused by the platform before the gate",
        set_qc("quant_method", "mxfp4"),
        ("NEURON-QCFG-MX", E, None),
    ),
    # rule 3: the scales
    case(
        "missing v_scale of layer 1",
        edit_scales(lambda t: {k: v for k, v in t.items() if k != V1}),
        (
            "SCALE-MISSING",
            E,
            "model.layers.1.self_attn.v_scale is missing: layer 1's V cache runs with "
            "scale 1.0 on Neuron (no error, no log line)",
        ),
    ),
    case(
        "scales under k_proj.output_scale",
        both(
            rename_scales("self_attn.k_scale", "self_attn.k_proj.output_scale"),
            rename_scales("self_attn.v_scale", "self_attn.v_proj.output_scale"),
        ),
        FOREIGN_K0,
        *[("SCALE-FOREIGN-NAME", E, None)] * 5,
    ),
    case(
        "one kv_scale per layer",
        edit_scales(
            lambda t: {k.replace("k_scale", "kv_scale"): v for k, v in t.items() if "k_scale" in k}
        ),
        (
            "SCALE-FOREIGN-NAME",
            E,
            "found model.layers.0.self_attn.kv_scale but Neuron reads only "
            "model.layers.0.self_attn.v_scale: layer 0's V cache runs with scale 1.0 on Neuron (no error, no log line)",
        ),
        *[("SCALE-FOREIGN-NAME", E, None)] * 5,
    ),
    case(
        "vllm module path self_attn.attn.k_scale",
        rename_scales("self_attn.k_scale", "self_attn.attn.k_scale"),
        *[("SCALE-FOREIGN-NAME", E, None)] * 3,
    ),
    case(
        "right leaf under a prefix Neuron does not read",
        rename_scales("model.layers.", "model.decoder.layers."),
        (
            "SCALE-FOREIGN-NAME",
            E,
            "found model.decoder.layers.0.self_attn.k_scale but Neuron reads only "
            "model.layers.0.self_attn.k_scale: layer 0's K cache runs with scale 1.0 on Neuron (no error, no log line)",
        ),
        *[("SCALE-FOREIGN-NAME", E, None)] * 5,
    ),
    case(
        "model.language_model.layers prefix is read",
        rename_scales("model.layers.", "model.language_model.layers."),
    ),
    case(
        "num_hidden_layers under text_config",
        edit_config(
            lambda c: c.update(text_config={"num_hidden_layers": c.pop("num_hidden_layers")})
        ),
    ),
    case(
        "no num_hidden_layers",
        edit_config(lambda c: c.pop("num_hidden_layers")),
        (
            "SCALE-LAYER-COUNT",
            W,
            "config.json has no usable num_hidden_layers: checked only the layers the scales "
            "name (0..2)",
        ),
    ),
    case(
        "a huge layer index in a scale name, no num_hidden_layers",
        both(
            edit_config(lambda c: c.pop("num_hidden_layers")),
            edit_scales(
                lambda t: t.__setitem__(
                    "model.layers.99999999999.self_attn.kv_scale", torch.tensor([0.1])
                )
            ),
        ),
        (
            "SCALE-LAYER-COUNT",
            W,
            "config.json has no usable num_hidden_layers: checked only the layers the scales "
            "name (0, 1, 2, 99999999999)",
        ),
        ("SCALE-FOREIGN-NAME", E, None),
        ("SCALE-FOREIGN-NAME", E, None),
    ),
    case(
        "an absurd num_hidden_layers is not used",
        edit_config(lambda c: c.update(num_hidden_layers=10**12)),
        ("SCALE-LAYER-COUNT", W, None),
    ),
    case(
        "more layers than scales",
        edit_config(lambda c: c.update(num_hidden_layers=4)),
        (
            "SCALE-MISSING",
            E,
            "model.layers.3.self_attn.k_scale is missing: layer 3's K cache runs with "
            "scale 1.0 on Neuron (no error, no log line)",
        ),
        ("SCALE-MISSING", E, None),
    ),
    case(
        "scales for layers the model lacks",
        edit_config(lambda c: c.update(num_hidden_layers=2)),
        (
            "SCALE-EXTRA-LAYER",
            W,
            "model.layers.2.self_attn.k_scale, model.layers.2.self_attn.v_scale: scale(s) "
            "for layers the model does not have (num_hidden_layers = 2); they are never read",
        ),
    ),
    case(
        "0-d scale crashes the loader",
        set_scale(K0, torch.tensor(0.05)),
        (
            "SCALE-SHAPE",
            E,
            "model.layers.0.self_attn.k_scale has shape [] (a 0-d scalar): the Neuron loader "
            "crashes with IndexError: slice() cannot be applied to a 0-dim tensor.",
        ),
    ),
    case(
        "per-head scales crash the reshape",
        set_scale(K0, torch.full((2,), 0.05)),
        (
            "SCALE-SHAPE",
            E,
            "model.layers.0.self_attn.k_scale has shape [2] (2 values, e.g. per-head): the Neuron "
            "loader's reshape to [1, 1] crashes (RuntimeError: shape '[1, 1]' is invalid for input of size 2)",
        ),
    ),
    case("shape [1, 1] loads", set_scale(K0, torch.full((1, 1), 10.0 / 240, dtype=torch.float32))),
    case(
        "zero scale",
        set_scale(K0, torch.tensor([0.0])),
        (
            "SCALE-VALUE",
            E,
            "model.layers.0.self_attn.k_scale = 0.0 is zero: a scale must be finite and > 0",
        ),
    ),
    case(
        "every k_scale zero",
        edit_scales(lambda t: {k: torch.zeros(1) if "k_scale" in k else v for k, v in t.items()}),
        (
            "SCALE-ALL-ZERO",
            E,
            "every k_scale is 0.0 (layers 0..2): no K was observed, and served with FP8 KV "
            "every K becomes inf or NaN (x / 0)",
        ),
    ),
    case(
        "negative scale",
        set_scale(K0, torch.tensor([-0.5])),
        (
            "SCALE-VALUE",
            E,
            "model.layers.0.self_attn.k_scale = -0.5 is negative: a scale must be finite and > 0",
        ),
    ),
    case(
        "nan scale",
        set_scale(K0, torch.tensor([float("nan")])),
        (
            "SCALE-VALUE",
            E,
            "model.layers.0.self_attn.k_scale = nan is not finite: a scale must be finite and > 0",
        ),
    ),
    case("inf scale", set_scale(K0, torch.tensor([float("inf")])), ("SCALE-VALUE", E, None)),
    case(
        "tiny scale: bf16 reciprocal is inf",
        set_scale(K0, torch.tensor([1e-40])),
        (
            "SCALE-VALUE",
            E,
            "model.layers.0.self_attn.k_scale = 9.99994610111476e-41: its reciprocal "
            "bf16(1 / bf16(s)), which Neuron stores, is not finite and non-zero",
        ),
    ),
    case(
        "huge scale overflows bf16", set_scale(K0, torch.tensor([3.4e38])), ("SCALE-VALUE", E, None)
    ),
    case(
        "float16 scale",
        set_scale(K0, torch.tensor([10.0 / 240], dtype=torch.float16)),
        ("SCALE-DTYPE", W, "model.layers.0.self_attn.k_scale is F16, not F32"),
        ("RANGE-PROVENANCE-DISAGREES", W, None),
    ),
    case(
        "every scale exactly 1.0",
        set_all_scales(1.0),
        (
            "SCALE-UNCALIBRATED",
            W,
            "every K and V scale is exactly 1.0: the checkpoint looks uncalibrated "
            "(the same as no scales)",
        ),
        ("RANGE-PROVENANCE-DISAGREES", W, None),
    ),
    case(
        "plain model: not calibrated",
        drop_kvcalib_files,
        (
            "SCALE-NONE",
            W,
            "no KV-cache scales in the checkpoint: not calibrated; with --kv-cache-dtype fp8 "
            "every layer runs with K and V scales 1.0",
        ),
    ),
    case(
        "kv_cache_scheme but no scales",
        both(unlink(SCALES_FILENAME), sync_index),
        (
            "SCALE-NONE",
            E,
            "no KV-cache scales in the checkpoint: not calibrated; with --kv-cache-dtype fp8 "
            "every layer runs with K and V scales 1.0 although quantization_config declares a kv_cache_scheme",
        ),
    ),
    case("scales without kv_cache_scheme", set_qc("", DELETE), ("SCALE-NO-KV-SCHEME", W, None)),
    case(
        "scales without kv_cache_scheme on gpu",
        set_qc("", DELETE),
        (
            "SCALE-NO-KV-SCHEME",
            E,
            "KV scales are present but quantization_config declares no kv_cache_scheme: "
            "GPU vLLM does not load them and runs FP8 KV with scales 1.0 (Neuron reads them with --kv-cache-dtype fp8)",
        ),
        ("RANGE-TARGET-MISMATCH", INFO, None),
        target="gpu",
    ),
    # rule 4: integrity
    case(
        "index names a file in a subdirectory",
        move_scales_into_subdir,
        ("CKPT-INDEX-FILE-NAME", E, None),
        ("SCALE-NONE", E, None),
    ),
    case(
        "index names a missing file",
        unlink("model-00003-of-00012.safetensors"),
        ("CKPT-INDEX-FILE-MISSING", E, None),
    ),
    case(
        "scale key in two files",
        add_extra_file({K0: torch.tensor([10.0 / 240])}),
        (
            "CKPT-DUPLICATE-KEY",
            E,
            "model.layers.0.self_attn.k_scale stored in more than one file "
            "(extra.safetensors, kv_scales.safetensors): which copy a loader uses is not defined",
        ),
    ),
    case(
        "scale key missing from weight_map",
        edit_index(lambda ix: ix["weight_map"].pop(K0)),
        (
            "CKPT-INDEX-KEY-UNMAPPED",
            E,
            "model.layers.0.self_attn.k_scale in kv_scales.safetensors is missing from "
            "weight_map: loaders that glob *.safetensors read it, index-based loaders silently ignore it "
            "(a scale missing there runs at 1.0)",
        ),
        ("CKPT-TOTAL-SIZE", W, None),
    ),
    case(
        "weight file missing from weight_map",
        add_extra_file({"lm_extra.weight": torch.zeros(2)}),
        ("CKPT-INDEX-KEY-UNMAPPED", W, None),
    ),
    case(
        "weight_map points at the wrong file",
        edit_index(lambda ix: ix["weight_map"].update({K0: "model-00001-of-00012.safetensors"})),
        (
            "CKPT-INDEX-KEY-STALE",
            E,
            "weight_map maps model.layers.0.self_attn.k_scale to "
            "model-00001-of-00012.safetensors, which holds no such tensor: an index-based loader cannot find it",
        ),
        ("CKPT-TOTAL-SIZE", W, None),
    ),
    case(
        "total_size off",
        edit_index(lambda ix: ix["metadata"].update(total_size=1)),
        (
            "CKPT-TOTAL-SIZE",
            W,
            "metadata.total_size is 1, but the tensors in weight_map hold 608024 bytes",
        ),
    ),
    case(
        "truncated scale file",
        write_bytes(SCALES_FILENAME, b"\x10\x00"),
        ("CKPT-HEADER", E, None),
        ("SCALE-NONE", E, None),
    ),
    case(
        "oversized header",
        write_bytes(SCALES_FILENAME, struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"),
        ("CKPT-HEADER", E, None),
        ("SCALE-NONE", E, None),
    ),
    case(
        "index not JSON",
        write_bytes(INDEX_FILENAME, b"{not json"),
        ("CKPT-INDEX-UNREADABLE", E, None),
    ),
    case(
        "weight_map not an object",
        edit_index(lambda ix: ix.update(weight_map=[])),
        (
            "CKPT-INDEX-UNREADABLE",
            E,
            "model.safetensors.index.json: its weight_map is not a JSON object: "
            "an index-based loader cannot use it",
        ),
    ),
    case(
        "no safetensors at all",
        lambda c: [p.unlink() for p in [*c.glob("*.safetensors"), c / INDEX_FILENAME]],
        ("CKPT-NO-SAFETENSORS", E, None),
        ("SCALE-NONE", E, None),
    ),
    # rule 5: target range
    case("448 scales on trn2 clip", calibrated_for_gpu, RANGE_448_ON_TRN2),
    case(
        "448 scales are fine on trn3",
        calibrated_for_gpu,
        ("PORT-TRN3-KV-PATH", INFO, None),
        target="trn3",
    ),
    case(
        "448 scales on trn2, provenance only in the header",
        both(calibrated_for_gpu, unlink(PROVENANCE_FILENAME)),
        RANGE_448_ON_TRN2,
    ),
    case(
        "provenance file and header disagree",
        as_gpu_calibration,
        RANGE_448_ON_TRN2,
        (
            "RANGE-PROVENANCE-DISAGREES",
            W,
            f"{PROVENANCE_FILENAME} says fp8_max 448.0, "
            f"{SCALES_FILENAME}:__metadata__['kvcalib'] says 240.0",
        ),
        ("RANGE-PROVENANCE-DISAGREES", W, None),
    ),
    case(
        "240 scales on gpu",
        None,
        (
            "RANGE-TARGET-MISMATCH",
            INFO,
            "scales were sized for FP8 max 240 (calibrated for trn2); gpu saturates at "
            "448: safe, using 240/448 ≈ 0.54 of the FP8 range",
        ),
        target="gpu",
    ),
    case(
        "a clip scored on trn2 alone, checked for gpu",
        clipped_layer_0(None),  # not "safe": only the warning
        (
            "RANGE-CLIPPED-UNSCORED",
            W,
            "the scale objective clipped 1 scale(s) (layer 0 K at 0.50 x absmax) scoring "
            "them on trn2 only, not on gpu: where gpu saturates elsewhere, a clip chosen to saturate near-constant "
            "channels can put them on FP8 rounding boundaries instead",
        ),
        target="gpu",
    ),
    case("a clip scored on trn2 alone is fine on trn2", clipped_layer_0(None)),
    case(
        "a clip scored on every server, checked for gpu",
        clipped_layer_0(["trn2", "trn3", "gpu", "vllm-cpu"]),
        ("RANGE-TARGET-MISMATCH", INFO, None),
        target="gpu",
    ),
    case(
        "hostile provenance: a negative range, a zero absmax, odd names",
        both(
            clipped_layer_0([None, {"a": 1}]),
            edit_provenance(
                lambda p: p["layers"][1].update(k={"range": -1.0, "absmax": 0.0}, layer="x" * 500)
            ),
        ),
        ("RANGE-CLIPPED-UNSCORED", W, None),
        target="gpu",
    ),  # no crash (a zero absmax), names cut short
    case(
        "no provenance",
        strip_scales_metadata_and_file,
        (
            "RANGE-UNKNOWN",
            INFO,
            "scales present, FP8 max unknown (no kvcalib provenance): scales sized as absmax/448 "
            "(llm-compressor, GPU vLLM) clip every value above 240/448 ≈ 0.54 of a layer's absmax on trn2",
        ),
    ),
    case(
        "scale edited after calibration",
        set_scale(K0, torch.tensor([0.5])),
        (
            "RANGE-PROVENANCE-DISAGREES",
            W,
            "1 scale(s) disagree with the provenance in kvcalib_calibration.json: "
            "model.layers.0.self_attn.k_scale is 0.5, provenance says 0.0416667",
        ),
    ),
    case(
        "0.1.0's flat provenance is read too",
        both(set_scale(K0, torch.tensor([0.5])), edit_provenance(flat_provenance)),
        (
            "RANGE-PROVENANCE-DISAGREES",
            W,
            "1 scale(s) disagree with the provenance in kvcalib_calibration.json: "
            "model.layers.0.self_attn.k_scale is 0.5, provenance says 0.0416667",
        ),
    ),
    case(
        "0.1.0's flat provenance: a clip scored on trn2 alone, checked for gpu",
        both(clipped_layer_0(None), edit_provenance(flat_provenance)),
        ("RANGE-CLIPPED-UNSCORED", W, None),
        target="gpu",
    ),
    case(
        "provenance file is not JSON",
        write_bytes(PROVENANCE_FILENAME, b"nope"),
        ("RANGE-PROVENANCE-MALFORMED", W, None),
    ),
    case(
        "provenance fp8_max not a number",
        edit_provenance(lambda p: p.update(fp8_max="lots")),
        ("RANGE-PROVENANCE-DISAGREES", W, None),
        ("RANGE-PROVENANCE-MALFORMED", W, None),
    ),
    # rule 6: portability
    case(
        "kv_cache_scheme with an unknown key",
        set_qc("kv_cache_scheme.calibration", {"dataset": "x"}),
        (
            "PORT-KV-SCHEME-INVALID",
            E,
            "kv_cache_scheme does not parse as compressed-tensors QuantizationArgs: "
            "calibration: Extra inputs are not permitted",
        ),
    ),
    case(
        "kv_cache_scheme not an object",
        set_qc("kv_cache_scheme", "fp8"),
        ("PORT-KV-SCHEME-INVALID", E, None),
    ),
    # the observer a kv_cache_scheme records: only static_minmax (kvcalib's) is the whole set's maximum
    case(
        "observer memoryless_minmax",
        set_qc("kv_cache_scheme.observer", "memoryless_minmax"),
        (
            "KV-OBSERVER",
            W,
            "kv_cache_scheme records observer 'memoryless_minmax': the last calibration batch's "
            "range only (each batch replaces the one before), so the scales come from one batch, not the whole set; "
            "K/V beyond those scales saturate in FP8",
        ),
    ),
    case("observer minmax", set_qc("kv_cache_scheme.observer", "minmax"), ("KV-OBSERVER", W, None)),
    case("observer mse", set_qc("kv_cache_scheme.observer", "mse"), ("KV-OBSERVER", W, None)),
    case(
        "no observer named",
        set_qc("kv_cache_scheme.observer", DELETE),
        (
            "KV-OBSERVER",
            W,
            "kv_cache_scheme names no observer: llm-compressor 0.14 then observes K/V with minmax, "
            "a moving average of the per-batch ranges (llm-compressor's averaging_constant, 0.01 by default), not "
            "their maximum, so the scales sit below the largest K/V the set produced; compressed-tensors versions "
            "that fill the field in (QuantizationArgs.validate_model_after) write memoryless_minmax, the last "
            "calibration batch's range only (each batch replaces the one before), so the scales come from one "
            "batch, not the whole set; K/V beyond those scales saturate in FP8",
        ),
    ),
    case(
        "no config_groups",
        set_qc("config_groups", DELETE),
        (
            "PORT-CONFIG-GROUPS-MISSING",
            W,
            "quantization_config has no config_groups: GPU vLLM's compressed-tensors "
            "loader indexes it and fails with KeyError: 'config_groups'",
        ),
    ),
    case(
        "no config_groups on gpu",
        set_qc("config_groups", DELETE),
        ("PORT-CONFIG-GROUPS-MISSING", E, None),
        ("RANGE-TARGET-MISMATCH", INFO, None),
        target="gpu",
    ),
    case(
        "per-channel kv scheme",
        set_qc("kv_cache_scheme.strategy", "channel"),
        (
            "PORT-KV-SCHEME-STRATEGY",
            E,
            "kv_cache_scheme has strategy='channel', dynamic=False: Neuron reads one "
            "static per-tensor scale per layer (strategy 'tensor', dynamic false)",
        ),
    ),
    case(
        "dynamic kv scheme",
        set_qc("kv_cache_scheme.dynamic", True),
        ("PORT-KV-SCHEME-STRATEGY", E, None),
    ),
    case(
        "attn_head on gpu is information (FlashAttention only; [1] scales broadcast over the heads)",
        set_qc("kv_cache_scheme.strategy", "attn_head"),
        (
            "PORT-KV-SCHEME-STRATEGY",
            INFO,
            "kv_cache_scheme has strategy 'attn_head' (one scale per KV head): GPU vLLM "
            "reads it on its FlashAttention backend only (other backends refuse per-head scales at startup)",
        ),
        ("RANGE-TARGET-MISMATCH", INFO, None),
        target="gpu",
    ),
    case(
        "int8 kv scheme",
        set_qc("kv_cache_scheme.type", "int"),
        (
            "PORT-KV-SCHEME-FORMAT",
            E,
            "kv_cache_scheme is num_bits=8, type='int', symmetric=True: FP8 KV needs "
            "num_bits 8, type 'float', symmetric true",
        ),
    ),
    case(
        "architecture without a Neuron scale loader",
        edit_config(lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral")),
        (
            "PORT-NO-SCALE-LOADER",
            W,
            "MistralForCausalLM has no Neuron KV-scale loader (only Llama, Qwen3 dense, "
            "Qwen3-MoE and GPT-OSS read them): on Neuron the scales are ignored and FP8 KV runs with scale 1.0",
        ),
    ),
    case(
        "qwen3.5 casts K/V to FP8 without scales",
        edit_config(
            lambda c: c.update(
                architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5"
            )
        ),
        (
            "PORT-NO-SCALE-LOADER",
            W,
            "Qwen3_5ForConditionalGeneration: the Neuron model casts K/V straight to FP8 "
            "with no scale and no clamp, so the scales are ignored and values beyond the FP8 range are not saturated",
        ),
    ),
    case(
        "qwen3-moe reads scales",
        edit_config(
            lambda c: c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        ),
    ),
    case(
        "model.safetensors beside an index hides the scales from transformers",
        shard_renamed_to_single_file,
        (
            "CKPT-SINGLE-FILE-SHADOWS-INDEX",
            W,
            "model.safetensors exists beside model.safetensors.index.json: "
            "transformers (and compressed-tensors through it) loads only model.safetensors and ignores "
            "model.layers.0.self_attn.k_scale, model.layers.0.self_attn.v_scale, model.layers.1.self_attn.k_scale, "
            "... (6 in all) in other files; vLLM and the Neuron loaders are not affected",
        ),
    ),
    case(
        "gpt-oss reads scales",
        edit_config(lambda c: c.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss")),
    ),
    case(
        "compression_config: the 2024 key",
        edit_config(lambda c: c.update(compression_config=c.pop("quantization_config"))),
        ("PORT-COMPRESSION-CONFIG", W, None),
        ("SCALE-NO-KV-SCHEME", W, None),
    ),
]


def assert_findings(
    report: ValidationReport, expected: tuple[tuple[str, str, str | None], ...]
) -> None:
    got = sorted((f.rule, f.severity) for f in report.findings)
    for f in (
        report.findings
    ):  # a code in the catalogue (kvcalib/validation/rules.py), at a severity it gives
        assert f.rule in RULE and f.severity in RULE[f.rule].severity, f
    assert got == sorted((rule, severity) for rule, severity, _ in expected), report.findings
    for rule, _, message in expected:
        if message is not None:
            assert message in [f.message for f in report.findings if f.rule == rule], (
                report.findings
            )
    assert report.ok == all(severity != "error" for _, severity, _ in expected)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_rules_on_real_checkpoints(c: Case, calibrated: Path) -> None:
    if c.mutate is not None:
        c.mutate(calibrated)
    assert_findings(validate_checkpoint(calibrated, c.target), c.expected)


# --- rule 1: the platform's validator, case for case --------------------------------------

ATTN_INPUT = {"input_activations": {"num_bits": 8, "type": "float"}}
WEIGHTS = {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}


def ct(groups: Any = DELETE, method: Any = "compressed-tensors", **extra: Any) -> dict:
    qc: dict[str, Any] = {"quant_method": method, **extra}
    if groups is not DELETE:
        qc["config_groups"] = groups
    return qc


def input_group(targets: Any = DELETE) -> dict:
    group = dict(ATTN_INPUT)
    if targets is not DELETE:
        group["targets"] = targets
    return {"group_0": group}


def rejected(what: str, group: str = "group_0") -> str:
    return f"{PREFIX} {what} in config_groups['{group}'] is not supported."


WEIGHTS_MSG = rejected("Weight quantization")
OUTPUT_MSG = rejected("Output activation quantization")
INPUT_MSG = rejected("Input activation quantization on non-attention targets")


def mx(method: str) -> str:
    return (
        f"Neuron does not support MX quantization: quant_method={method!r}. The Neuron matmul substrate has no "
        "MX path."
    )


MXFP8 = {"quantization": "mxfp8"}
# (name, quantization_config, neuron_config, rule or None, exact message or None)
VERDICTS = [
    ("absent", None, None, None, None),
    ("empty object", {}, None, None, None),
    ("kvcalib's kv-only config", "KV_ONLY", None, None, None),
    ("empty config_groups", ct({}), None, None, None),
    ("no config_groups", ct(), None, None, None),
    ("LlamaAttention target", ct(input_group(["LlamaAttention"])), None, None, None),
    ("re:.*Attention$ target", ct(input_group(["re:.*Attention$"])), None, None, None),
    (
        "attention target after another",
        ct(input_group(["re:.*q_proj", "Attention"])),
        None,
        None,
        None,
    ),
    (
        "targets as an object: keys are iterated",
        ct(input_group({"LlamaAttention": 1})),
        None,
        None,
        None,
    ),
    ("a list target: Python tests membership", ct(input_group([["Attention"]])), None, None, None),
    (
        "a list target without the exact element",
        ct(input_group([["LlamaAttention"]])),
        None,
        "NEURON-QCFG-INPUT-ACT",
        INPUT_MSG,
    ),
    (
        "a later non-string target is never reached",
        ct(input_group(["LlamaAttention", 5])),
        None,
        None,
        None,
    ),
    (
        "no input activations: targets never read",
        ct({"g": {"input_activations": None, "targets": None}}),
        None,
        None,
        None,
    ),
    (
        "falsy weights and output activations",
        ct({"g": {"weights": {}, "output_activations": False}}),
        None,
        None,
        None,
    ),
    ("fp8 is accepted by the platform", ct({"g": WEIGHTS}, "fp8"), None, None, None),
    ("FP8 spelled in capitals", ct({"g": WEIGHTS}, "FP8"), None, None, None),
    ("another method is accepted", ct({"g": WEIGHTS}, "gptq"), None, None, None),
    (
        "missing quant_method is not compressed-tensors",
        {"config_groups": {"g": WEIGHTS}},
        None,
        None,
        None,
    ),
    (
        "compressed-tensors with a space is not it",
        ct({"g": WEIGHTS}, "compressed tensors"),
        None,
        None,
        None,
    ),
    ("mxfp8 neuron_config accepts MX", ct(method="mxfp4"), MXFP8, None, None),
    ("mxfp8 neuron_config accepts weights", ct({"g": WEIGHTS}), MXFP8, None, None),
    ("weights", ct({"group_0": WEIGHTS}), None, "NEURON-QCFG-WEIGHTS", WEIGHTS_MSG),
    (
        "Compressed_Tensors spelling is normalised",
        ct({"group_0": WEIGHTS}, "Compressed_Tensors"),
        None,
        "NEURON-QCFG-WEIGHTS",
        WEIGHTS_MSG,
    ),
    (
        "weights win over output activations",
        ct({"group_0": {**WEIGHTS, "output_activations": {"num_bits": 8}}}),
        None,
        "NEURON-QCFG-WEIGHTS",
        WEIGHTS_MSG,
    ),
    (
        "output activations",
        ct({"group_0": {"output_activations": {"num_bits": 8}}}),
        None,
        "NEURON-QCFG-OUTPUT-ACT",
        OUTPUT_MSG,
    ),
    (
        "groups in file order",
        ct({"a": {"targets": ["LlamaAttention"]}, "b": WEIGHTS, "c": {"output_activations": 1}}),
        None,
        "NEURON-QCFG-WEIGHTS",
        rejected("Weight quantization", "b"),
    ),
    (
        "input activations on Linear",
        ct(input_group(["Linear"])),
        None,
        "NEURON-QCFG-INPUT-ACT",
        INPUT_MSG,
    ),
    (
        "re:.*self_attn$ is not an attention target",
        ct(input_group(["re:.*self_attn$"])),
        None,
        "NEURON-QCFG-INPUT-ACT",
        INPUT_MSG,
    ),
    (
        "attention match is case-sensitive",
        ct(input_group(["llamaattention"])),
        None,
        "NEURON-QCFG-INPUT-ACT",
        INPUT_MSG,
    ),
    (
        "targets as a string never match",
        ct(input_group("LlamaAttention")),
        None,
        "NEURON-QCFG-INPUT-ACT",
        INPUT_MSG,
    ),
    ("missing targets", ct(input_group()), None, "NEURON-QCFG-INPUT-ACT", INPUT_MSG),
    ("empty targets", ct(input_group([])), None, "NEURON-QCFG-INPUT-ACT", INPUT_MSG),
    ("mxfp4", ct(method="mxfp4"), None, "NEURON-QCFG-MX", mx("mxfp4")),
    ("MXFP8 is lower-cased", ct(method="MXFP8"), None, "NEURON-QCFG-MX", mx("mxfp8")),
    (
        "gpt_oss_mxfp4",
        {"quant_method": "gpt_oss_mxfp4"},
        None,
        "NEURON-QCFG-MX",
        mx("gpt_oss_mxfp4"),
    ),
    (
        "modelopt_mxfp8",
        {"quant_method": "modelopt_mxfp8"},
        None,
        "NEURON-QCFG-MX",
        mx("modelopt_mxfp8"),
    ),
    (
        "another neuron_config quantization",
        ct(method="mxfp4"),
        {"quantization": "fp8"},
        "NEURON-QCFG-MX",
        mx("mxfp4"),
    ),
    (
        "quantization_config an array",
        [],
        None,
        "NEURON-QCFG-MALFORMED",
        "quantization_config is an array, not an object: vLLM crashes reading it (quant_cfg.get) before the "
        "Neuron platform can check it",
    ),
    ("quantization_config a string", "compressed-tensors", None, "NEURON-QCFG-MALFORMED", None),
    ("quantization_config false", False, None, "NEURON-QCFG-MALFORMED", None),
    (
        "quant_method null",
        {"quant_method": None},
        None,
        "NEURON-QCFG-MALFORMED",
        "quantization_config.quant_method is null, not a string: vLLM crashes normalising it (quant_method.lower())",
    ),
    (
        "config_groups null",
        ct(None),
        None,
        "NEURON-QCFG-MALFORMED",
        "quantization_config.config_groups is null, not an object: the Neuron platform crashes iterating it "
        "(config_groups.items())",
    ),
    ("config_groups an array", ct([WEIGHTS]), None, "NEURON-QCFG-MALFORMED", None),
    (
        "a group that is not an object",
        ct({"group_0": ["weights"]}),
        None,
        "NEURON-QCFG-MALFORMED",
        "config_groups['group_0'] is an array, not an object: the Neuron platform crashes reading it (group.get)",
    ),
    (
        "targets null with input activations",
        ct(input_group(None)),
        None,
        "NEURON-QCFG-MALFORMED",
        "config_groups['group_0'].targets is null while input_activations is set: the Neuron platform crashes "
        "iterating it (TypeError)",
    ),
    (
        "targets a number with input activations",
        ct(input_group(7)),
        None,
        "NEURON-QCFG-MALFORMED",
        "config_groups['group_0'].targets is a number while input_activations is set: the Neuron platform crashes "
        "iterating it (TypeError)",
    ),
    (
        "a non-string target",
        ct(input_group(["Linear", 7])),
        None,
        "NEURON-QCFG-MALFORMED",
        "config_groups['group_0'].targets[1] is a number, not a string: the Neuron platform crashes testing it "
        "for 'Attention' (TypeError)",
    ),
]


def _qc(value: Any) -> Any:
    return kv_only_quantization_config() if value == "KV_ONLY" else value


@pytest.mark.parametrize(
    "name,qc,neuron_config,rule,message", VERDICTS, ids=[v[0] for v in VERDICTS]
)
def test_neuron_quantization_verdict(name, qc, neuron_config, rule, message) -> None:
    verdict = neuron_quantization_verdict(_qc(qc), neuron_config)
    if rule is None:
        assert verdict is None
    else:
        assert verdict is not None and (verdict.rule, verdict.severity) == (rule, "error")
        if message is not None:
            assert verdict.message == message


@pytest.mark.parametrize(
    "name,qc,neuron_config,rule,message", VERDICTS, ids=[v[0] for v in VERDICTS]
)
def test_neuron_quantization_verdict_through_a_checkpoint(
    name, qc, neuron_config, rule, message, calibrated
) -> None:
    edit_config(lambda c: c.update(quantization_config=_qc(qc)))(calibrated)
    report = validate_checkpoint(calibrated, "trn2", neuron_config=neuron_config)
    platform = [f for f in report.findings if f.rule.startswith("NEURON-QCFG-")]
    assert [(f.rule, f.message if message else None) for f in platform] == (
        [(rule, message)] if rule else []
    )


# --- what cannot be validated at all ------------------------------------------------------


@pytest.mark.parametrize(
    "setup,error,message",
    [
        (
            lambda c: shutil.rmtree(c),
            CheckpointNotFoundError,
            "checkpoint directory not found: {c}",
        ),
        (
            lambda c: (c / CONFIG_FILENAME).unlink(),
            CheckpointNotFoundError,
            "config.json not found: {c}/config.json",
        ),
        (
            lambda c: (c / CONFIG_FILENAME).write_text("[1, 2]"),
            CheckpointReadError,
            "{c}/config.json is not a JSON object",
        ),
        (
            lambda c: (c / CONFIG_FILENAME).write_text("{"),
            CheckpointReadError,
            "cannot parse config.json {c}/config.json",
        ),
    ],
    ids=["no directory", "no config.json", "config not an object", "config not JSON"],
)
def test_unreadable_checkpoint_raises(calibrated: Path, setup, error, message) -> None:
    setup(calibrated)
    with pytest.raises(error) as info:
        validate_checkpoint(calibrated)
    assert str(info.value).startswith(message.format(c=calibrated))


def test_unknown_target_raises(calibrated: Path) -> None:
    with pytest.raises(UnknownTargetError) as info:
        validate_checkpoint(calibrated, "trn1")
    assert (str(info.value), info.value.hint) == (
        "unknown target 'trn1'; known targets: gpu, trn2, trn3",
        "use --target trn2, trn3 or gpu",
    )


# --- the report ---------------------------------------------------------------------------


def test_report_json_and_strict(tiny_llama: Path) -> None:
    lenient = validate_checkpoint(tiny_llama, "trn3")
    strict = validate_checkpoint(tiny_llama, "trn3", strict=True)
    assert [f.rule for f in lenient.warnings] == ["SCALE-NONE"] and lenient.errors == ()
    assert (lenient.ok, strict.ok) == (True, False)
    as_dict = json.loads(json.dumps(to_json(strict)))
    assert sorted(as_dict) == ["checkpoint", "findings", "ok", "target"]
    assert as_dict["ok"] is False and as_dict["target"] == "trn3"
    assert list(as_dict["findings"][0]) == ["rule", "severity", "message", "hint", "location"]


def test_location_names_the_config_group(calibrated: Path) -> None:
    edit_config(lambda c: c["quantization_config"].update(config_groups={"group_0": WEIGHTS}))(
        calibrated
    )
    (finding,) = validate_checkpoint(calibrated).errors
    assert finding.location == "config.json:quantization_config.config_groups['group_0']"


def test_scale_finding_location_names_file_and_key(calibrated: Path) -> None:
    set_scale(K0, torch.tensor([0.0]))(calibrated)
    (finding,) = validate_checkpoint(calibrated).errors
    assert finding.location == f"{SCALES_FILENAME}:{K0}"


# --- what is read -------------------------------------------------------------------------


def test_reads_only_the_scale_tensors(calibrated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors
    import safetensors.torch

    from kvcalib.core import checkpoint

    read: list[str] = []
    real = checkpoint.read_values  # the public reader validate uses for every tensor it reads
    monkeypatch.setattr(
        checkpoint,
        "read_values",
        lambda header, key, count=None: read.append(key) or real(header, key, count),
    )
    real_open = safetensors.safe_open

    class HeaderOnly:  # safetensors may check a header (read_safetensors_header), never hand out a tensor
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self) -> HeaderOnly:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.file.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            pytest.fail(f"safe_open(...).{name}: a tensor was read through safetensors")

    for module in (safetensors, safetensors.torch):
        if hasattr(module, "load_file"):
            monkeypatch.setattr(
                module,
                "load_file",
                lambda *a, **k: pytest.fail("a whole safetensors file was read"),
            )
        if hasattr(module, "safe_open"):
            monkeypatch.setattr(module, "safe_open", HeaderOnly)
    assert validate_checkpoint(calibrated).findings == ()
    assert sorted(read) == sorted(neuron_scale_key(i, kind) for i in range(3) for kind in "kv")


def test_agrees_with_the_checkpoint_writer(tiny_llama_master: Path, tmp_path: Path) -> None:
    """What calibrate.writer.write_checkpoint writes validates clean."""
    scales = {
        neuron_scale_key(i, kind): torch.tensor([(i + 1) / 240.0])
        for i in range(3)
        for kind in "kv"
    }
    layers = [
        {"layer": i, **{k: {"absmax": i + 1.0, "scale": (i + 1) / 240.0} for k in "kv"}}
        for i in range(3)
    ]
    plan = WritePlan(
        scales,
        kv_only_quantization_config(),
        {"target": "trn2", "fp8_max": 240.0, "layers": layers},
    )
    write_checkpoint(tiny_llama_master, tmp_path / "out", plan)
    assert validate_checkpoint(tmp_path / "out").findings == ()


# --- the header reader and JSON reader (the checks behind CKPT-HEADER) --------------------


def _header_file(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


@pytest.mark.parametrize(
    "make,problem",
    [
        (lambda p: p.write_bytes(b"\x01\x02"), REFUSED),
        (lambda p: _header_file(p, b"{}", length=64), REFUSED),
        (lambda p: _header_file(p, b"{}", length=MAX_HEADER_BYTES + 1), REFUSED),
        (lambda p: _header_file(p, b"{nope"), REFUSED),
        (lambda p: _header_file(p, b"[" * 100_000), REFUSED),
        (lambda p: _header_file(p, b"[1]"), REFUSED),
        (
            lambda p: _header_file(
                p, b'{"t": {"dtype": [1], "shape": [1], "data_offsets": [0, 4]}}', data=b"\0" * 4
            ),
            REFUSED,
        ),
        (
            lambda p: _header_file(
                p, b'{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', data=b"\0" * 4
            ),
            REFUSED,
        ),
        (
            lambda p: _header_file(
                p, b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', data=b"\0" * 8
            ),
            REFUSED,
        ),
        (
            lambda p: _header_file(
                p, b'{"t": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}', data=b"\0"
            ),
            "dtype F4, which kvcalib cannot read",
        ),
    ],
    ids=[
        "no length",
        "truncated header",
        "oversized header",
        "not JSON",
        "nested too deep",
        "not an object",
        "unhashable dtype",
        "data past the end",
        "bytes no tensor covers",
        "a dtype kvcalib cannot read",
    ],
)
def test_header_reader_refuses_broken_files(tmp_path: Path, make, problem) -> None:
    """safetensors' own checks (the message names the file and what it found), then kvcalib's dtypes."""
    path = tmp_path / "x.safetensors"
    make(path)
    with pytest.raises(CheckpointReadError) as info:
        read_safetensors_header(path)
    assert str(info.value).startswith(f"{path}: ") and problem in str(info.value)


@pytest.mark.parametrize(
    "text,message",
    [
        ("[" * 100_000, "cannot parse x {p}"),
        ('{"n": ' + "1" * 5000 + "}", "cannot parse x {p}: Exceeds the limit (4300 digits)"),
        ("{", "cannot parse x {p}: Expecting property name"),
    ],
    ids=["deep", "huge integer", "not JSON"],
)
def test_read_json_turns_every_parse_failure_into_a_read_error(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(CheckpointReadError) as info:
        read_json(path, "x")
    assert info.value.message.startswith(message.format(p=path)), info.value.message
    assert "restore it from the original checkpoint" in info.value.hint, info.value.hint


def _schemes() -> list:
    plain = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    variants = [
        dict(plain, observer=o)
        for o in ("static_minmax", "minmax", "mse", "memoryless_minmax", None)
    ]
    variants.append(dict(plain))
    changes = {
        "num_bits": [4, 16, "8", 8.0, True],
        "type": ["int", "FLOAT", None],
        "symmetric": [False, 1, "true"],
        "strategy": ["channel", "token", "attn_head", "group", "TENSOR", None],
        "dynamic": [True, "local", 0, None],
        "observer": [7, ["minmax"]],
        "group_size": [128, None],
        "calibration": [{"dataset": "x"}],
    }
    for key, values in changes.items():
        variants += [dict(plain, **{key: v}) for v in values]
    variants += [{k: v for k, v in plain.items() if k != key} for key in plain]
    return variants + ["fp8", None, [], {}, 8]


@pytest.mark.parametrize("target", ["trn2", "gpu"])
def test_plain_kv_scheme_fast_path_agrees_with_compressed_tensors(target):
    """validate recognises the plain static per-tensor FP8 scheme without compressed-tensors (and torch): on
    every scheme of the table the verdict is compressed-tensors' own."""
    from kvcalib.core.schema import kv_only_quantization_config
    from kvcalib.validation import config

    schemes = _schemes() + [kv_only_quantization_config()["kv_cache_scheme"]]
    fast = [s for s in schemes if config._plain_fp8_scheme(s)]
    assert len(fast) == 7 and config._plain_fp8_scheme(
        kv_only_quantization_config()["kv_cache_scheme"]
    )
    for (
        scheme
    ) in fast:  # the fast path skips compressed-tensors' parse, which finds nothing in them
        assert config._parsed_kv_scheme_findings(scheme, target) == [], scheme


def test_validate_imports_neither_torch_nor_transformers(handmade_master):
    """`kvcalib validate` as a process: no torch, transformers or compressed-tensors on the path."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom kvcalib.cli import main\nsys.argv = ['kvcalib', 'validate', sys.argv[1]]\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'compressed_tensors', 'datasets') "
        "if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(handmade_master)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout + done.stderr
