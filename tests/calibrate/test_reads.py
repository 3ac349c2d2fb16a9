"""One calibrate run reads config.json and each safetensors header of the input checkpoint once."""

from __future__ import annotations

import shutil

import pytest
from count_reads import count_opens

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate


@pytest.mark.parametrize("engine", ["auto", "native", "stream"])
def test_one_calibrate_reads_each_input_file_once(
    engine, tiny_llama_master, text_dataset, tmp_path
):
    # a copy of its own: no earlier run in this process has seen these paths
    model = shutil.copytree(tiny_llama_master, tmp_path / "model")
    with count_opens(model) as opens:
        calibrate(
            model,
            str(text_dataset),
            tmp_path / "out",
            CalibrateOptions(num_samples=8, max_seq_len=32, engine=engine),
        )
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    assert len(shards) > 1  # a sharded checkpoint: every header counts
    assert opens.get("config.json") == 1
    assert opens.get("model.safetensors.index.json") == 1
    for shard in shards:
        assert opens.get(shard) == 1, (shard, opens)
    # (other files are opened only to copy them: the tokenizer, the chat template)
