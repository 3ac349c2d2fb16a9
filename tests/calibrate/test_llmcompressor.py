"""llm-compressor interop: the recipes run in its own oneshot, the engine, and the cross-check against it.

The cross-check prints its per-layer table (run with `pytest -s` to read it): the native
engine's absmax against llm-compressor's static_minmax and against llm-compressor's default
K/V observer (below the absmax).

In float32 the two engines agree to float32 rounding. In bf16 they differ by up to one bf16
step of the K/V values plus the rounding of llm-compressor's bf16 scale: llm-compressor forces
eager attention while it calibrates (llmcompressor.utils.helpers.use_eager_attention), and
eager and SDPA attention round differently in bf16, so the layers after the first see slightly
different hidden states. kvcalib observes the model as transformers runs it (SDPA, exactly the
K/V of transformers' own cache, test_smollm2.py); llm-compressor's scales are exactly
bf16(absmax / 448) of an eager-attention forward (asserted below).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import REPO, assert_scale_sized
from oracle import calibration_sequences, oracle_absmax

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.schema import PROVENANCE_FILENAME, SCALES_FILENAME, neuron_scale_key

pytestmark = [
    pytest.mark.proof("llmcompressor"),
    pytest.mark.skipif(
        importlib.util.find_spec("llmcompressor") is None,
        reason="llm-compressor is not installed (the optional extra: pip install "
        "kvcalib[llmcompressor])",
    ),
]

RECIPES = REPO / "recipes"
TINY = dict(num_samples=12, max_seq_len=128)
SMOL = dict(num_samples=6, max_seq_len=128)
BF16_SCALE_ROUNDING = (
    2.0**-8
)  # half a bf16 step, relative: llm-compressor holds scales in the model's dtype
BF16_STEP = 2.0**-7  # one bf16 step of a K/V value, relative (at most)


def default_observer_recipe(path):
    """recipes/kv-fp8-gpu.yaml without `observer`: llm-compressor picks its default for K/V."""
    recipe = yaml.safe_load((RECIPES / "kv-fp8-gpu.yaml").read_text())
    del recipe["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["kv_cache_scheme"][
        "observer"
    ]
    path.write_text(yaml.safe_dump(recipe))
    return path


def token_dataset(sequences):
    from datasets import Dataset

    return Dataset.from_dict(
        {"input_ids": sequences, "attention_mask": [[1] * len(s) for s in sequences]}
    )


def saved_scales(ckpt):
    """Every *_scale tensor in a checkpoint directory, by key."""
    from safetensors.torch import load_file

    scales = {}
    for path in ckpt.glob("*.safetensors"):
        scales.update(
            {k: v for k, v in load_file(path).items() if k.endswith(("k_scale", "v_scale"))}
        )
    return scales


def eager_absmax(model_dir, sequences):
    """K/V absmax from transformers' own cache after a plain forward with eager attention, one sample at a time."""
    return oracle_absmax(model_dir, sequences, attn_implementation="eager")


def cross_check(native, static, label, default=None):
    """Per-layer relative differences; prints the table, returns the largest |static - native| / native and, per
    layer-kind, how far the default observer's absmax is below the native one (none without `default`)."""
    print(
        f"\n{label}: layer, kind, native absmax, static_minmax rel diff, default observer rel diff"
    )
    largest = 0.0
    below = []
    for i, (n, s) in enumerate(zip(native.layers, static.layers)):
        for kind in ("k", "v"):
            a, b = getattr(n, kind).absmax, getattr(s, kind).absmax
            largest = max(largest, abs(b - a) / a)
            row = f"{label} {n.layer:3d} {kind} {a:10.5g} {(b - a) / a:+.2e}"
            if default is not None:
                below.append((a - getattr(default.layers[i], kind).absmax) / a)
                row += f" {-below[-1]:+.2%}"
            print(row)
    print(f"{label}: largest |static_minmax - native| / native over all layers: {largest:.2e}")
    return largest, below


def engines(model, dataset, root, data_opts, *recipes):
    """The same samples through the native engine and llm-compressor's oneshot with each recipe, all computing
    natively (oneshot does; the native engine would emulate bf16 in float32 on a CPU without bf16)."""
    opts = dict(target="gpu", batch_size=1, bf16_compute="native", **data_opts)
    native = calibrate(model, str(dataset), root / "native", CalibrateOptions(**opts))
    return native, *(
        calibrate(
            model,
            str(dataset),
            root / f"llmc{i}",
            CalibrateOptions(engine="llmcompressor", recipe=str(recipe), **opts),
        )
        for i, recipe in enumerate(recipes)
    )


@pytest.fixture(scope="module")
def tiny_runs(tiny_llama_master, text_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("llmc-tiny")
    default = default_observer_recipe(root / "default.yaml")
    return (
        *engines(tiny_llama_master, text_dataset, root, TINY, RECIPES / "kv-fp8-gpu.yaml", default),
        root,
    )


@pytest.mark.parametrize("target", ["trn2", "trn3", "gpu"])
def test_recipes_run_in_llmcompressors_own_oneshot(
    target, tiny_llama_master, text_dataset, tiny_runs, tmp_path
):
    """Each recipe as it is, in a user's oneshot call: it runs, and its scales are absmax / 448 even for trn2."""
    from llmcompressor import oneshot

    native = tiny_runs[0]
    sequences = calibration_sequences(tiny_llama_master, text_dataset, **TINY)
    out = tmp_path / "oneshot"
    oneshot(
        model=str(tiny_llama_master),
        recipe=str(RECIPES / f"kv-fp8-{target}.yaml"),
        dataset=token_dataset(sequences),
        num_calibration_samples=len(sequences),
        output_dir=str(out),
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["observer"] == "static_minmax"
    scales = saved_scales(out)
    for layer in native.layers:
        for kind in ("k", "v"):
            expected = (
                getattr(layer, kind).absmax / 448
            )  # what llm-compressor can size for, whatever the target
            assert scales[neuron_scale_key(layer.layer, kind)].item() == pytest.approx(
                expected, rel=1e-6
            )


def test_tiny_native_equals_llmcompressor_static_minmax(tiny_runs):
    native, static, default, _ = tiny_runs
    largest, below = cross_check(native, static, "tiny", default)
    assert largest <= 1e-6  # float32 model: scales held in float32
    for s, d in zip(
        static.layers, default.layers
    ):  # a moving average of per-batch maxima stays below their maximum
        assert d.k.absmax <= s.k.absmax * (1 + 1e-6) and d.v.absmax <= s.v.absmax * (1 + 1e-6)
    assert max(below) > 0.01, (
        "llm-compressor's default observer is expected to end below the absmax"
    )


def test_llmcompressor_default_observer_depends_on_sample_order(
    tiny_llama_master, text_dataset, tmp_path
):
    """oneshot's default shuffles the samples; its default K/V observer then gives other scales per order."""
    from llmcompressor import oneshot

    sequences = calibration_sequences(tiny_llama_master, text_dataset, **TINY)
    recipe = default_observer_recipe(tmp_path / "default.yaml")
    runs = []
    for order in (sequences, sequences[::-1]):
        out = tmp_path / f"run{len(runs)}"
        oneshot(
            model=str(tiny_llama_master),
            recipe=str(recipe),
            dataset=token_dataset(order),
            num_calibration_samples=len(order),
            shuffle_calibration_samples=False,
            output_dir=str(out),
        )
        runs.append(saved_scales(out))
    differ = [key for key in runs[0] if not torch.equal(runs[0][key], runs[1][key])]
    assert differ, "the same samples in another order gave the same scales"


def test_engine_end_to_end_from_the_command_line(
    tiny_llama_master, text_dataset, tiny_runs, tmp_path
):
    """A real `python -m kvcalib` process: stdout is JSON only (llm-compressor logs to stdout by default)."""
    native = tiny_runs[0]
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("LLM_COMPRESSOR_LOG_DISABLED", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcalib",
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(out),
            "--engine",
            "llmcompressor",
            "--recipe",
            str(RECIPES / "kv-fp8-trn2.yaml"),
            "--num-calibration-samples",
            str(TINY["num_samples"]),
            "--max-seq-length",
            str(TINY["max_seq_len"]),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert (
        payload["target"] == "trn2"
        and payload["fp8_max"] == 240.0
        and payload["validation"]["ok"] is True
    )
    from safetensors.torch import load_file

    scales = load_file(out / SCALES_FILENAME)
    for mine, theirs in zip(native.layers, payload["layers"]):
        for kind in ("k", "v"):
            assert theirs[kind]["absmax"] == pytest.approx(getattr(mine, kind).absmax, rel=1e-6)
            key = neuron_scale_key(mine.layer, kind)
            assert scales[key].dtype == torch.float32 and scales[key].shape == (1,)
            assert_scale_sized(
                scales[key].item(), theirs[kind]["range"], "trn2"
            )  # the objective's chosen range
    provenance = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert provenance["engine"] == "llmcompressor" and provenance["observer"] == "static_minmax"
    assert provenance["llmcompressor_version"] and provenance["recipe"] == str(
        RECIPES / "kv-fp8-trn2.yaml"
    )


@pytest.mark.slow
def test_smollm2_native_equals_llmcompressor_static_minmax(smollm2, text_dataset, tmp_path):
    """static_minmax on a real bf16 model (the default observer's drift below the absmax: the tiny test)."""
    native, static = engines(smollm2, text_dataset, tmp_path, SMOL, RECIPES / "kv-fp8-gpu.yaml")
    largest, _ = cross_check(native, static, "smollm2")
    assert len(native.layers) == 30
    assert largest <= BF16_STEP + BF16_SCALE_ROUNDING
    # why they differ: llm-compressor's scales are bf16(absmax / 448) of an eager-attention forward, exactly
    k, v = eager_absmax(smollm2, calibration_sequences(smollm2, text_dataset, **SMOL))
    for layer, k_eager, v_eager in zip(static.layers, k.tolist(), v.tolist()):
        for theirs, eager in ((layer.k.absmax, k_eager), (layer.v.absmax, v_eager)):
            assert theirs == pytest.approx(
                torch.tensor(eager / 448).bfloat16().item() * 448, rel=1e-6
            ), layer.layer


def test_per_head_native_equals_llmcompressor_attn_head(tiny_llama_master, text_dataset, tmp_path):
    """--strategy attn_head in both engines: llm-compressor's own per-head static_minmax scales ([kv_heads, 1, 1])
    stand for the same per-head absmax kvcalib measures (float32 model: to float32 rounding)."""
    from safetensors.torch import load_file

    recipe = yaml.safe_load((RECIPES / "kv-fp8-gpu.yaml").read_text())
    recipe["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["kv_cache_scheme"][
        "strategy"
    ] = "attn_head"
    (tmp_path / "heads.yaml").write_text(yaml.safe_dump(recipe))
    opts = dict(target="gpu", batch_size=1, **TINY)
    native = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "native",
        CalibrateOptions(strategy="attn_head", **opts),
    )
    theirs = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "llmc",
        CalibrateOptions(engine="llmcompressor", recipe=str(tmp_path / "heads.yaml"), **opts),
    )
    for mine, other in zip(native.layers, theirs.layers):
        assert len(other.k.head_absmax) == 2
        assert list(other.k.head_absmax) == pytest.approx(list(mine.k.head_absmax), rel=1e-6)
        assert list(other.v.head_absmax) == pytest.approx(list(mine.v.head_absmax), rel=1e-6)
    assert load_file(tmp_path / "llmc" / "kv_scales.safetensors")[
        "model.layers.0.self_attn.k_scale"
    ].shape == (2, 1, 1)
