"""The newest transformers and compressed-tensors beside the pinned ones (scripts/test.sh's second leg, in
./.venv-newest): the same calibrate command, run once in each environment, writes the same k_scale and v_scale
tensors, and validate says the same of both checkpoints. KVCALIB_PINNED_PYTHON names the pinned environment's
python (./.venv); without it (the first leg, or a run by hand) the proof skips and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from kvcalib.core.checkpoint import Checkpoint, load_tensors
from kvcalib.core.schema import is_kv_scale_key

PINNED = os.environ.get("KVCALIB_PINNED_PYTHON")
pytestmark = [
    pytest.mark.proof("stacks"),
    pytest.mark.skipif(
        not PINNED,
        reason="runs in scripts/test.sh's second leg, where KVCALIB_PINNED_PYTHON names the pinned "
        "environment's python",
    ),
]


def _run(python: str, *args: str) -> dict:
    done = subprocess.run(
        [python, "-m", "kvcalib", *args, "--json"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _versions(python: str) -> str:
    code = "import transformers, compressed_tensors as c; print(transformers.__version__, c.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def _scales(checkpoint: Path) -> dict:
    files = Checkpoint.open(checkpoint).files
    keys = [k for k in files.key_files if is_kv_scale_key(k)]
    found: dict = {}
    for file in {str(files.file_of(k)) for k in keys}:
        found.update(
            load_tensors(checkpoint / file, [k for k in keys if str(files.file_of(k)) == file])
        )
    return found


def test_the_newest_stack_writes_the_pinned_stacks_scales(smollm2, text_dataset, tmp_path):
    checkpoint = smollm2
    assert _versions(PINNED) != _versions(sys.executable), "two environments with one stack"
    args = ["--dataset", str(text_dataset), "--num-samples", "8", "--max-seq-len", "128"]
    runs = {
        name: _run(python, "calibrate", str(checkpoint), *args, "-o", str(tmp_path / name))
        for name, python in {"pinned": PINNED, "newest": sys.executable}.items()
    }
    pinned, newest = (_scales(tmp_path / name) for name in runs)
    assert pinned.keys() == newest.keys() and len(pinned) >= 2
    for key, scale in pinned.items():
        assert scale.dtype == newest[key].dtype and scale.equal(newest[key]), key
    assert [layer["k"]["range"] for layer in runs["pinned"]["layers"]] == [
        layer["k"]["range"] for layer in runs["newest"]["layers"]
    ]
    validated = {
        name: json.dumps(
            _run(python, "validate", str(tmp_path / name), "--target", "trn2")["findings"]
        ).replace(str(tmp_path / name), "<OUT>")
        for name, python in {"pinned": PINNED, "newest": sys.executable}.items()
    }
    assert validated["pinned"] == validated["newest"]
    assert transformers.__version__ in _versions(sys.executable)
