"""--recipe: llm-compressor recipes read with compressed-tensors; schemes the target cannot serve are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO
from typer.testing import CliRunner

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.calibration.recipe import load_recipe, plan_recipe, recipe_file
from kvcalib.cli import app
from kvcalib.core.errors import MissingDependencyError, RecipeError
from kvcalib.core.schema import PROVENANCE_FILENAME, kv_cache_scheme_args

RECIPES = REPO / "recipes"
FP8 = dict(
    num_bits=8,
    type="float",
    strategy="tensor",
    dynamic=False,
    symmetric=True,
    observer="static_minmax",
)
SMALL = dict(num_samples=4, max_seq_len=32)
runner = CliRunner()


def write_recipe(path, kv_cache_scheme=None, target=None, **modifier_args):
    """An llm-compressor recipe with one QuantizationModifier (and kvcalib's target, if given)."""
    recipe = {}
    if target is not None:
        recipe["kvcalib"] = {"target": target}
    args = dict(modifier_args)
    if kv_cache_scheme is not None:
        args["kv_cache_scheme"] = kv_cache_scheme
    recipe["quant_stage"] = {"quant_modifiers": {"QuantizationModifier": args}}
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("target", ["trn2", "trn3", "gpu"])
def test_shipped_recipes_hold_kvcalibs_scheme_and_their_target(target):
    recipe = load_recipe(RECIPES / f"kv-fp8-{target}.yaml")
    assert recipe.target == target
    assert recipe.location == "quant_stage.quant_modifiers.QuantizationModifier"
    assert recipe.scheme == kv_cache_scheme_args().model_dump(mode="json")
    assert recipe.observer == "static_minmax" and recipe.ignored == ()
    plan = plan_recipe(RECIPES / f"kv-fp8-{target}.yaml", None, "native")
    assert (plan.target, plan.observer, plan.warnings) == (target, "static_minmax", ())


REFUSED = [
    # (case, kv_cache_scheme changes, target, message after "<path>: quant_stage...kv_cache_scheme ")
    (
        "dynamic",
        dict(dynamic=True),
        "trn2",
        "has dynamic: True, which trn2 cannot serve: vLLM reads static per-layer KV scales from the checkpoint",
    ),
    (
        "per-head on trn2",
        dict(strategy="attn_head"),
        "trn2",
        "has strategy attn_head (one scale per KV head), which trn2 cannot serve: vLLM on Neuron reads one k_scale "
        "and one v_scale per layer, and its loader's reshape to [1, 1] crashes on a per-head scale",
    ),
    (
        "per-head on trn3",
        dict(strategy="attn_head"),
        "trn3",
        "has strategy attn_head (one scale per KV head), which trn3 cannot serve: vLLM on Neuron reads one k_scale "
        "and one v_scale per layer, and its loader's reshape to [1, 1] crashes on a per-head scale",
    ),
    (
        "int8",
        dict(type="int"),
        "trn2",
        "has type 'int' (8-bit integer KV), which trn2 cannot serve: vLLM keeps an FP8 KV cache (type float, "
        "num_bits 8); compressed-tensors reads a missing type as int",
    ),
    (
        "no type is int",
        dict(type=None),
        "gpu",
        "has type 'int' (8-bit integer KV), which gpu cannot serve",
    ),
    (
        "fp4",
        dict(num_bits=4),
        "trn3",
        "has num_bits 4, which trn3 cannot serve: vLLM's KV cache is FP8 (num_bits 8)",
    ),
    (
        "asymmetric",
        dict(symmetric=False),
        "trn2",
        "has symmetric: false (a zero point), which trn2 cannot serve: vLLM's FP8 KV cache is symmetric "
        "(x = fp8 * scale)",
    ),
    (
        "per-channel",
        dict(strategy="channel"),
        "gpu",
        "has strategy 'channel', which is no KV-cache strategy gpu serves",
    ),
    (
        "fp16 bits",
        dict(num_bits=16),
        "trn2",
        "is not a valid compressed-tensors QuantizationArgs: Only num_bits in (8) are supported",
    ),
    (
        "unknown field",
        dict(fp8_max=240),
        "trn2",
        "is not a valid compressed-tensors QuantizationArgs: fp8_max: Extra inputs are not permitted",
    ),
    (
        "dynamic local",
        dict(dynamic="local"),
        "trn2",
        "is not a valid compressed-tensors QuantizationArgs: local is only supported for strategy tensor_group",
    ),
]


@pytest.mark.parametrize("case,changes,target,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_schemes_the_target_cannot_serve_are_refused(case, changes, target, message, tmp_path):
    scheme = {k: v for k, v in {**FP8, **changes}.items() if v is not None}
    path = write_recipe(tmp_path / "recipe.yaml", scheme)
    with pytest.raises(RecipeError) as exc:
        plan_recipe(path, target, "native")
    assert exc.value.message.startswith(
        f"{path}: quant_stage.quant_modifiers.QuantizationModifier.kv_cache_scheme {message}"
    ), exc.value.message
    assert exc.value.hint


def test_a_per_head_recipe_sets_the_strategy_for_gpu(tmp_path):
    path = write_recipe(tmp_path / "recipe.yaml", {**FP8, "strategy": "attn_head"})
    assert plan_recipe(path, "gpu", "native").strategy == "attn_head"
    assert plan_recipe(None, "gpu", "native", "attn_head").strategy == "attn_head"
    assert plan_recipe(None, "gpu", "native").strategy == "tensor"
    with pytest.raises(RecipeError) as exc:
        plan_recipe(path, "gpu", "native", "tensor")
    assert exc.value.message == (
        f"--strategy tensor contradicts {path}, whose kv_cache_scheme has strategy attn_head"
    )


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_per_head_is_refused_for_neuron_before_anything_is_loaded(target, tmp_path):
    """--strategy attn_head on a Neuron target: refused with the loader's reason, before the model is even found."""
    from kvcalib.core.errors import UsageError

    with pytest.raises(UsageError) as exc:
        calibrate(
            tmp_path / "no-such-model",
            str(tmp_path / "no-such-data"),
            tmp_path / "out",
            CalibrateOptions(target=target, strategy="attn_head"),
        )
    assert exc.value.message == (
        f"--strategy attn_head (one scale per KV head) cannot serve on {target}: vLLM on Neuron reads one k_scale "
        "and one v_scale per layer, and its loader's reshape to [1, 1] crashes on a per-head scale "
        "(RuntimeError: shape '[1, 1]' is invalid)"
    )
    assert "--target gpu" in exc.value.hint
    with pytest.raises(UsageError, match="unknown --strategy 'channel'"):
        CalibrateOptions(strategy="channel").check_arguments()
    assert not (tmp_path / "out").exists()


def test_unreadable_recipes(tmp_path):
    def recipe(name, text):
        (tmp_path / name).write_text(text)
        return tmp_path / name

    two = {
        "quant_stage": {
            "quant_modifiers": {
                "QuantizationModifier": {"kv_cache_scheme": FP8},
                "GPTQModifier": {"kv_cache_scheme": {**FP8, "observer": "minmax"}},
            }
        }
    }
    cases = [
        (tmp_path / "missing.yaml", f"recipe not found: {tmp_path / 'missing.yaml'}"),
        (
            recipe("bad.yaml", "quant_stage: [unclosed"),
            f"{tmp_path / 'bad.yaml'}: not a YAML or JSON recipe (",
        ),
        (
            recipe("list.yaml", "- 1\n- 2\n"),
            f"{tmp_path / 'list.yaml'}: a recipe is a mapping of `<name>_stage` sections, not list",
        ),
        (
            write_recipe(tmp_path / "w8a8.yaml", None, scheme="W8A8", targets=["Linear"]),
            f"{tmp_path / 'w8a8.yaml'}: no kv_cache_scheme in the recipe",
        ),
        (
            recipe("two.yaml", json.dumps(two)),
            f"{tmp_path / 'two.yaml'}: 2 different kv_cache_scheme entries "
            "(quant_stage.quant_modifiers.QuantizationModifier, quant_stage.quant_modifiers.GPTQModifier)",
        ),
        (
            write_recipe(tmp_path / "h100.yaml", FP8, target="h100"),
            f"{tmp_path / 'h100.yaml'}: kvcalib.target 'h100' is not a known target",
        ),
        (
            recipe("extra.yaml", "kvcalib: {target: trn2, fp8_max: 240}\n"),
            f"{tmp_path / 'extra.yaml'}: kvcalib must be a mapping with the key target only",
        ),
        (
            recipe(
                "scalar.yaml",
                yaml.safe_dump(
                    {
                        "quant_stage": {
                            "quant_modifiers": {"QuantizationModifier": {"kv_cache_scheme": "fp8"}}
                        }
                    }
                ),
            ),
            f"{tmp_path / 'scalar.yaml'}: quant_stage.quant_modifiers.QuantizationModifier.kv_cache_scheme "
            "must be a mapping",
        ),
    ]
    for path, message in cases:
        with pytest.raises(RecipeError) as exc:
            load_recipe(path)
        assert exc.value.message.startswith(message), exc.value.message


def test_target_comes_from_the_recipe_unless_given(tmp_path):
    plain = write_recipe(tmp_path / "plain.yaml", FP8)
    assert plan_recipe(RECIPES / "kv-fp8-gpu.yaml", None, "native").target == "gpu"
    assert plan_recipe(RECIPES / "kv-fp8-gpu.yaml", "gpu", "native").target == "gpu"
    assert plan_recipe(plain, None, "native").target == "trn2"
    assert plan_recipe(plain, "trn3", "native").target == "trn3"
    assert plan_recipe(None, None, "native").target == "trn2"
    with pytest.raises(RecipeError) as exc:
        plan_recipe(RECIPES / "kv-fp8-trn2.yaml", "gpu", "native")
    assert exc.value.message == (
        f"--target gpu contradicts {RECIPES / 'kv-fp8-trn2.yaml'}, which is for trn2 "
        "(kvcalib.target)"
    )
    assert exc.value.hint == "drop --target, or use --recipe gpu"


def test_shipped_recipes_by_name(tmp_path, monkeypatch):
    """--recipe trn2|trn3|gpu: the recipes kvcalib ships (here the source tree's recipes/; installed, the package
    data kvcalib.recipes: tests/test_wheel.py); a file of that name in the working directory is the user's."""
    for name in ("trn2", "trn3", "gpu"):
        assert recipe_file(name) == RECIPES / f"kv-fp8-{name}.yaml"
        assert plan_recipe(name, None, "native").target == name
    monkeypatch.chdir(tmp_path)
    write_recipe(tmp_path / "gpu", FP8)
    assert recipe_file("gpu") == Path("gpu") and plan_recipe("gpu", None, "native").target == "trn2"
    with pytest.raises(RecipeError) as exc:
        load_recipe("trn4")
    assert "trn4" in exc.value.message and exc.value.hint.endswith("trn2, trn3, gpu"), exc.value


def test_what_kvcalib_does_not_run_is_said(tmp_path):
    w8a8 = write_recipe(tmp_path / "w8a8.yaml", FP8, scheme="W8A8", targets=["Linear"])
    assert plan_recipe(w8a8, None, "native").warnings == (
        f"{w8a8}: kvcalib runs the kv_cache_scheme only and ignores quant_stage.quant_modifiers.QuantizationModifier "
        "(scheme)",
    )
    minmax = write_recipe(tmp_path / "minmax.yaml", {**FP8, "observer": "minmax"})
    assert plan_recipe(minmax, None, "native").warnings == (
        f"{minmax}: observer 'minmax'; the native engine measures the absmax over every token (static_minmax); "
        "--engine llmcompressor runs the recipe's observer",
    )
    default = write_recipe(
        tmp_path / "default.yaml", {k: v for k, v in FP8.items() if k != "observer"}
    )
    assert plan_recipe(default, None, "native").warnings == (
        f"{default}: no observer (llm-compressor would run 'minmax'); the native engine measures the absmax over "
        "every token (static_minmax); --engine llmcompressor runs the recipe's observer",
    )


def test_cli_recipe_sets_target_and_provenance(tiny_llama_master, text_dataset, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_llama_master),
            "--dataset",
            str(text_dataset),
            "-o",
            str(out),
            "--num-samples",
            "4",
            "--max-seq-len",
            "32",
            "--recipe",
            str(RECIPES / "kv-fp8-gpu.yaml"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["target"] == "gpu" and payload["fp8_max"] == 448.0
    provenance = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert provenance["recipe"] == str(RECIPES / "kv-fp8-gpu.yaml")
    assert provenance["observer"] == "static_minmax" and provenance["engine"] == "native"
    assert provenance["kv_cache_scheme"]["observer"] == "static_minmax"


def test_cli_refuses_before_anything_is_loaded(tiny_llama_master, text_dataset, tmp_path):
    recipe = write_recipe(tmp_path / "int8.yaml", {**FP8, "type": "int"})
    cases = [
        (
            ["--recipe", str(recipe)],
            2,
            f"error: {recipe}: quant_stage.quant_modifiers.QuantizationModifier.kv_cache_scheme has type 'int'",
        ),
        (
            ["--recipe", str(RECIPES / "kv-fp8-trn2.yaml"), "--target", "trn3"],
            2,
            f"error: --target trn3 contradicts {RECIPES / 'kv-fp8-trn2.yaml'}, which is for trn2",
        ),
        (
            ["--recipe", str(tmp_path / "nope.yaml")],
            2,
            f"error: recipe not found: {tmp_path / 'nope.yaml'}",
        ),
    ]
    for extra, code, first_line in cases:
        result = runner.invoke(
            app,
            [
                "calibrate",
                str(tiny_llama_master),
                "--dataset",
                str(text_dataset),
                "-o",
                str(tmp_path / "o"),
                *extra,
            ],
        )
        assert result.exit_code == code, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith(first_line), result.stderr
        assert (
            lines[-1].startswith("hint: ")
            and "Traceback" not in result.stderr
            and result.stdout == ""
        )
    assert not (tmp_path / "o").exists()


def test_engine_llmcompressor_without_llmcompressor_says_how_to_get_it(
    tiny_llama_master, text_dataset, tmp_path, monkeypatch
):
    monkeypatch.setitem(
        sys.modules, "llmcompressor", None
    )  # what `import llmcompressor` sees when it is absent
    with pytest.raises(MissingDependencyError) as exc:
        calibrate(
            tiny_llama_master,
            str(text_dataset),
            tmp_path / "o",
            CalibrateOptions(engine="llmcompressor", **SMALL),
        )
    assert (
        exc.value.message == "--engine llmcompressor needs llm-compressor, which is not installed"
    )
    assert exc.value.hint == "pip install kvcalib[llmcompressor]"
    args = ["calibrate", str(tiny_llama_master), "--dataset", str(text_dataset)]
    args += ["-o", str(tmp_path / "o"), "--engine", "llmcompressor"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: --engine llmcompressor needs llm-compressor, which is not installed",
        "hint: pip install kvcalib[llmcompressor]",
    ]
    assert not (tmp_path / "o").exists()
    # flags that cannot work together are said first: installing the extra would not make them work
    both = runner.invoke(app, [*args, "--attention-scales"])
    assert both.exit_code == 2 and both.stderr.startswith(
        "error: --attention-scales observes Q with kvcalib's own engines"
    )


def test_help_names_the_extra():
    result = runner.invoke(app, ["calibrate", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    assert "pip install kvcalib[llmcompressor]" in result.stdout and "--recipe" in result.stdout


def test_llm_compressors_fp8_attention_recipe_means_attention_scales(
    tiny_llama_master, text_dataset, tmp_path
):
    """llm-compressor's FP8-attention example (a config group on LlamaAttention's input activations, no
    kv_cache_scheme: it quantises K/V with the same arguments) calibrates Q too, as --attention-scales does."""
    attention = {
        "targets": ["LlamaAttention"],
        "input_activations": {**FP8, "strategy": "attn_head"},
    }
    path = write_recipe(
        tmp_path / "attention.yaml", target="gpu", config_groups={"attention": attention}
    )
    recipe = load_recipe(path)
    assert recipe.attention and recipe.scheme["strategy"] == "attn_head" and recipe.ignored == ()
    plan = plan_recipe(path, None, "native")
    assert (plan.strategy, plan.attention_scales) == ("attn_head", True)
    result = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(recipe=str(path), **SMALL),
    )
    assert len(result.layers[0].q.head_scales) == 4 and len(result.layers[0].k.head_scales) == 2
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["attention"]["targets"] == ["LlamaAttention"]
    # the same group beside a kv_cache_scheme that differs: one KV format only
    clash = write_recipe(
        tmp_path / "clash.yaml", FP8, target="gpu", config_groups={"attention": attention}
    )
    with pytest.raises(RecipeError, match="2 different kv_cache_scheme entries"):
        load_recipe(clash)
    # a weight group beside it is still reported as ignored
    mixed = write_recipe(
        tmp_path / "mixed.yaml",
        target="gpu",
        config_groups={
            "attention": attention,
            "w8": {"targets": ["Linear"], "weights": {**FP8, "strategy": "channel"}},
        },
    )
    assert load_recipe(mixed).ignored == (
        "quant_stage.quant_modifiers.QuantizationModifier (config_groups)",
    )
