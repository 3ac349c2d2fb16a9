"""One calibrate run reads config.json and each safetensors header of the input checkpoint once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

COUNTER = REPO / "tests" / "support" / "count_reads.py"


@pytest.mark.parametrize("engine", ["auto", "native", "stream"])
def test_one_calibrate_reads_each_input_file_once(
    engine, tiny_llama_master, text_dataset, tmp_path
):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(COUNTER),
            str(tiny_llama_master),
            str(text_dataset),
            str(tmp_path / "out"),
            engine,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    opens = json.loads(proc.stdout.strip().splitlines()[-1])
    shards = sorted(p.name for p in tiny_llama_master.glob("*.safetensors"))
    assert len(shards) > 1  # a sharded checkpoint: every header counts
    assert opens.get("config.json") == 1
    assert opens.get("model.safetensors.index.json") == 1
    for shard in shards:
        assert opens.get(shard) == 1, (shard, opens)
    # (other files are opened only to copy them: the tokenizer, the chat template)
