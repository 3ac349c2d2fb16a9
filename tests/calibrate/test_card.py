"""The model card calibrate writes into the output (kvcalib/calibration/card.py)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvcalib.calibration.card import (
    BEGIN,
    CHECKPOINT_PLACEHOLDER,
    END,
    SERVE_PORT,
    TAGS,
    write_card,
)
from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.cli import app
from kvcalib.core.schema import SCALES_FILENAME
from kvcalib.serving.launch import server_argv
from kvcalib.serving.options import ServeOptions

SMALL = {"num_samples": 4, "max_seq_len": 32}
USER_CARD = "---\nlicense: apache-2.0\ntags: [tiny]\n---\n# Tiny Llama\n\nThe user's own words.\n"


@pytest.fixture
def carded(tiny_llama_master, tmp_path) -> Path:
    src = shutil.copytree(tiny_llama_master, tmp_path / "src")
    (src / "README.md").write_text(USER_CARD)
    return src


def test_front_matter_parses_with_huggingface_hub(carded, text_dataset, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "out"
    calibrate(carded, str(text_dataset), out, CalibrateOptions(**SMALL))
    card = ModelCard.load(out / "README.md")
    assert set(TAGS) | {"tiny"} <= set(card.data.tags) and card.data.license == "apache-2.0"
    assert (
        card.text.startswith("# Tiny Llama\n\nThe user's own words.\n")
        and card.text.count(BEGIN) == 1
    )
    assert (carded / "README.md").read_text() == USER_CARD  # the input's card is never written


def scale_table(text: str) -> list[dict[str, float]]:
    """The card's per-layer table: a dict per row, by column name."""
    lines = text[text.index("| layer |") :].splitlines()
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(names, (float(c) for c in line.strip("|").split("|"))))
        for line in lines[2:]
        if line.startswith("| ")
    ]


def test_scale_table_is_the_scales_file(calibrate_tiny):
    out = calibrate_tiny(**SMALL)
    text = (out / "README.md").read_text()
    rows = scale_table(text)
    scales = load_file(out / SCALES_FILENAME)
    assert [row["layer"] for row in rows] == [0, 1, 2]
    for row in rows:
        for kind in "kv":
            value = float(scales[f"model.layers.{int(row['layer'])}.self_attn.{kind}_scale"])
            assert row[f"{kind}_scale"] == pytest.approx(value, rel=1e-5)
    assert (
        "OK for trn2: 0 error(s), 0 warning(s)" in text
        and "sized for **trn2** (E4M3, max 240)" in text
    )


FORMULAS = {
    "attention": {},
    "absmax": {"scale_objective": "absmax"},
    "headroom": {"scale_objective": "absmax", "headroom": 2.0},
    "per-head": {"target": "gpu", "strategy": "attn_head"},
}


@pytest.mark.parametrize("name", FORMULAS)
def test_the_formula_states_what_was_written(name, planted_master, text_dataset, tmp_path):
    """The card's first paragraph is what the scales are: absmax / 240 where nothing else was chosen, else the
    range the objective (or --headroom) chose, shown per layer; it names what clips and every server it was
    scored on (on the tiny Llama with near-constant K channels, whose layer 0 K the objective clips), and it
    stays short: the details are in the table and the provenance."""
    out = tmp_path / name
    result = calibrate(
        planted_master,
        str(text_dataset),
        out,
        CalibrateOptions(num_samples=16, max_seq_len=64, **FORMULAS[name]),
    )
    text = (out / "README.md").read_text()
    rows = scale_table(text)
    summary = text.split("## FP8 KV cache (kvcalib)\n\n")[1].split("\n\n")[0]
    assert summary.startswith("Per-") and len(summary.split()) < 80, summary
    if name == "absmax":
        assert (
            "`k_scale = absmax(K) / 240` per layer" in text
            and "Nothing clips: right on trn2, trn3, gpu, vllm-cpu." in text
            and "k range" not in text
        )
        return
    if name == "headroom":
        assert (
            "`k_scale = range(K) / 240` per layer" in text
            and "The range is 2 x absmax(K) (--headroom). Nothing clips: right on trn2, trn3, gpu, "
            "vllm-cpu."
            in text
        )
        return
    if (
        name == "per-head"
    ):  # GPU FlashAttention alone serves per-head scales: scored there, claimed nowhere else
        assert "per head, after rotary embedding" in text and "Nothing clips: right on gpu." in text
        assert json.loads((out / "kvcalib_calibration.json").read_text())["scored_on"] == ["gpu"]
        return
    assert result.layers[0].k.range < result.layers[0].k.absmax  # clipped
    assert "`k_scale = range(K) / 240` per layer" in text
    assert "with the least error in the attention block's output" in text
    assert "Clipped below absmax: K in layer 0. Scored on trn2 and on trn3, gpu, vllm-cpu," in text
    for row, layer in zip(rows, result.layers):
        for kind in "kv":
            assert row[f"{kind} range"] == pytest.approx(getattr(layer, kind).range, rel=1e-5)
            # rounded up onto the bf16 grid so that the chip never saturates the range (core.fp8.scale_from_absmax)
            assert row[f"{kind}_scale"] * 240 / row[f"{kind} range"] == pytest.approx(
                1.0, abs=2**-6
            )


def test_recalibration_replaces_its_section_and_keeps_the_users_text(
    carded, text_dataset, tmp_path
):
    first, second = tmp_path / "first", tmp_path / "second"
    calibrate(carded, str(text_dataset), first, CalibrateOptions(**SMALL))
    with open(first / "README.md", "a") as f:
        f.write("\nA note the user added after calibrating.\n")
    calibrate(first, str(text_dataset), second, CalibrateOptions(target="gpu", **SMALL))
    text = (second / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "sized for **gpu**" in text
    assert "sized for **trn2**" not in text
    assert "The user's own words." in text and "A note the user added after calibrating." in text


def test_serve_commands_are_the_ones_serve_check_runs(calibrate_tiny):
    """Each server gets its own command: Neuron's packed FP8 prefill (a whole prompt in one batch) and host
    sampling (no async scheduling) are Neuron's flags, not GPU vLLM's."""
    out = calibrate_tiny(**SMALL)
    blocks = re.findall(r"```bash\n(.*?)\n```", (out / "README.md").read_text(), re.S)
    expected = [
        shlex.join(
            server_argv(
                ServeOptions(device, vllm_python=Path("python")),
                Path(CHECKPOINT_PLACEHOLDER),
                SERVE_PORT,
                True,
            )
        )
        for device in ("trn2", "cuda")
    ]
    assert blocks == expected and all("--kv-cache-dtype fp8" in b for b in blocks)
    neuron, gpu = blocks
    for flag in ("--max-num-batched-tokens 2048", "--no-async-scheduling"):
        assert flag in neuron and flag not in gpu, flag


def test_the_kv_cache_it_buys_is_in_the_summary_and_the_card(
    tiny_llama_master, text_dataset, tmp_path
):
    """calibrate's summary and card give the KV bytes per token and per sequence, bf16 and FP8; on a
    GPT-OSS-120B-shaped config.json the card reads the design doc's figures and the sliding-window ones."""
    out = tmp_path / "out"
    run = CliRunner().invoke(
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
            "--json",
        ],
    )
    assert run.exit_code == 0, run.stderr
    config = json.loads((out / "config.json").read_text())
    per_token = (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * 2
        * config["hidden_size"]
        // config["num_attention_heads"]
    )
    context = config["max_position_embeddings"]
    assert json.loads(run.stdout)["kv_cache"]["sequence"] == {
        "bf16": per_token * context,
        "fp8": per_token // 2 * context,
    }
    assert (
        f"KV cache: {per_token:,} B/token bf16, {per_token // 2:,} FP8; one {context:,}-token sequence"
        in run.stderr
    )
    config.update(
        num_hidden_layers=36,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
    )
    (out / "config.json").write_text(json.dumps(config))
    write_card(out, "OK")
    card = (out / "README.md").read_text()
    assert (
        "| KV cache | 73,728 B/token bf16, 36,864 FP8; one 131,072-token sequence (max_position_embeddings): "
        "9.66 GB bf16, 4.83 GB FP8 (its 18 sliding-window layers holding 128 tokens: 4.84 GB bf16, "
        "2.42 GB FP8) |"
    ) in card
