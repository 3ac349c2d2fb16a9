"""calibrate.publish on real directories: both publish paths, and what `recover` does with each leftover."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcalib.calibration import publish
from kvcalib.calibration.publish import MARKER, Staging, recover, stage
from kvcalib.core.errors import OutputExistsError


def checkpoint(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(text)
    return path


def names(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
def test_publish_replaces_the_old_output_and_leaves_nothing(tmp_path, monkeypatch, exchange):
    if not exchange:

        def unsupported(*a):
            raise OSError(errno.EINVAL, "no RENAME_EXCHANGE")

        monkeypatch.setattr(publish, "_rename_exchange", unsupported)
    out = checkpoint(tmp_path / "out", "old")
    staging = stage(out)
    assert json.loads((staging.root / MARKER).read_text())["output"] == "out"
    checkpoint(staging.checkpoint, "new")
    publish.publish(staging)
    assert (out / "config.json").read_text() == "new" and names(tmp_path) == ["out"]


def test_publish_to_a_new_path(tmp_path):
    staging = stage(tmp_path / "out")
    checkpoint(staging.checkpoint, "new")
    publish.publish(staging)
    assert (tmp_path / "out" / "config.json").read_text() == "new" and names(tmp_path) == ["out"]


def write_marker(root: Path, pid: int) -> None:
    root.mkdir()
    (root / MARKER).write_text(
        json.dumps(
            {"output": "out", "pid": pid, "host": publish.socket.gethostname(), "started": 0.0}
        )
    )


def test_recover_restores_the_old_output_a_killed_fallback_publish_moved_away(tmp_path):
    root = tmp_path / ".out.kvcalib-abc"
    pid = dead_pid()
    write_marker(root, pid)
    checkpoint(root / "old", "old")
    checkpoint(root / "checkpoint", "new")
    notes = recover(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == "old" and names(tmp_path) == ["out"]
    assert notes == [
        f"restored the previous {tmp_path / 'out'} from .out.kvcalib-abc, left by an interrupted run "
        f"(pid {pid})"
    ]


def test_recover_removes_staging_and_an_empty_sibling(tmp_path):
    checkpoint(tmp_path / "out", "current")
    write_marker(tmp_path / ".out.kvcalib-1", dead_pid())
    checkpoint(tmp_path / ".out.kvcalib-1" / "checkpoint", "half")
    (tmp_path / ".out.kvcalib-2").mkdir()  # killed between mkdtemp and the marker
    notes = recover(tmp_path / "out")
    assert (
        names(tmp_path) == ["out"] and (tmp_path / "out" / "config.json").read_text() == "current"
    )
    assert len(notes) == 2 and all("left by an interrupted run" in n for n in notes)


def test_recover_leaves_what_it_cannot_prove_is_its_own(tmp_path):
    checkpoint(
        tmp_path / ".out.kvcalib-legacy", "someone's"
    )  # no marker: an earlier version, or a user's
    notes = recover(tmp_path / "out")
    assert names(tmp_path) == [".out.kvcalib-legacy"]
    assert len(notes) == 1 and "left alone" in notes[0]


def test_recover_refuses_while_the_writer_runs(tmp_path):
    root = tmp_path / ".out.kvcalib-live"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
        try:
            write_marker(root, proc.pid)
            marker = json.loads((root / MARKER).read_text())
            marker["started"] = (
                publish.time.time()
            )  # written after the process began: the same process
            (root / MARKER).write_text(json.dumps(marker))
            with pytest.raises(OutputExistsError, match=f"another kvcalib \\(pid {proc.pid}\\)"):
                recover(tmp_path / "out")
            assert root.exists()
        finally:
            proc.kill()


def test_a_reused_pid_is_not_a_live_writer(tmp_path):
    """The marker's pid runs, but that process began after the marker was written: another program."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
        try:
            write_marker(
                tmp_path / ".out.kvcalib-old", proc.pid
            )  # started 0.0: long before the process
            assert len(recover(tmp_path / "out")) == 1 and names(tmp_path) == []
        finally:
            proc.kill()


def test_discard_is_idempotent(tmp_path):
    staging = stage(tmp_path / "out")
    publish.discard(staging)
    publish.discard(Staging(staging.root, staging.output))
    assert names(tmp_path) == []


def test_large_extra_files_are_linked_small_ones_copied(tiny_llama_master, tmp_path):
    """A pytorch_model.bin beside the safetensors costs no space; an editable tokenizer file is a copy."""
    import shutil

    import torch

    from kvcalib.calibration.writer import LINK_AT_BYTES, WritePlan, bytes_needed, write_checkpoint
    from kvcalib.core.checkpoint import Checkpoint
    from kvcalib.core.schema import kv_only_quantization_config, neuron_scale_key

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_master, src)
    with open(src / "pytorch_model.bin", "wb") as f:  # sparse: its size, none of its blocks
        f.truncate(LINK_AT_BYTES)
    layers = Checkpoint.open(src).config["num_hidden_layers"]
    scales = {
        neuron_scale_key(i, kind): torch.tensor([0.01]) for i in range(layers) for kind in "kv"
    }
    write_checkpoint(src, tmp_path / "out", WritePlan(scales, kv_only_quantization_config(), {}))
    out = tmp_path / "out"
    assert (out / "pytorch_model.bin").stat().st_ino == (src / "pytorch_model.bin").stat().st_ino
    assert (out / "tokenizer.json").stat().st_ino != (src / "tokenizer.json").stat().st_ino
    linked, copied = (
        bytes_needed(Checkpoint.open(src), True),
        bytes_needed(Checkpoint.open(src), False),
    )
    assert copied - linked >= LINK_AT_BYTES  # the .bin counts only where links fail
