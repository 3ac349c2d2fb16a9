"""validate --target gpu and vLLM's own loading of k_scale/v_scale/q_scale agree, family by family: the table
(kvcalib/validation/vllm_scales.json, written by scripts/vllm_scales_table.py) is what vLLM's loader did, and
validate refuses exactly where a release leaves a scale at 1.0."""

from __future__ import annotations

import json
import os

import pytest
from checkpoints import make_calibrated, read_json, write_json
from helpers import import_script, no_vllm_reason

from kvcalib.api import validate
from kvcalib.validation import config as validation_config

VLLM_PYTHON = os.environ.get("KVCALIB_VLLM_PYTHON")
RULE = "PORT-VLLM-DROPS-SCALES"


def test_the_page_is_the_table():
    table = json.loads(validation_config.VLLM_SCALES.read_text())
    script = import_script("vllm_scales_table")
    assert script.MD_OUT.read_text() == script.render(table), (
        "run python scripts/vllm_scales_table.py"
    )


def test_validate_refuses_each_family_exactly_where_a_release_drops_a_scale(
    tiny_llama, tmp_path, monkeypatch
):
    table = json.loads(validation_config.VLLM_SCALES.read_text())
    ckpt = make_calibrated(tiny_llama, target="gpu")
    for release in table.values():
        for family, row in release["families"].items():
            write_json(
                ckpt / "config.json",
                read_json(ckpt / "config.json") | {"architectures": [row["architecture"]]},
            )
            assert RULE not in {f.rule for f in validate(ckpt, target="gpu").findings}, family
            dropped = {"9.9": {"how": "run", "families": {family: row | {"v_scale": False}}}}
            (tmp_path / "dropped.json").write_text(json.dumps(dropped))
            monkeypatch.setattr(validation_config, "VLLM_SCALES", tmp_path / "dropped.json")
            [finding] = [f for f in validate(ckpt, target="gpu").findings if f.rule == RULE]
            assert finding.severity == "error" and finding.message.startswith(
                "vLLM 9.9 serves this FP8 KV cache with v_scale 1.0"
            ), family
            assert RULE not in {f.rule for f in validate(ckpt, target="trn2").findings}
            monkeypatch.undo()


@pytest.mark.proof("vllm-loader")
@pytest.mark.skipif(not VLLM_PYTHON, reason=no_vllm_reason())
def test_vllms_own_loader_loads_what_the_table_says(tmp_path):
    """Every family kvcalib calibrates, through vLLM CPU's get_model (scripts/vllm_scales_table.py); no FP8 kernel
    is needed, so this runs wherever the vLLM CPU environment is built."""
    version, rows = import_script("vllm_scales_table").loaded_by_vllm(VLLM_PYTHON, tmp_path)
    table = json.loads(validation_config.VLLM_SCALES.read_text())
    assert rows == table[version]["families"]
