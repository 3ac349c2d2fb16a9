"""A filesystem that is too small, or fills up mid-write: one clear error, OUT as it was, nothing left.

Runs on a real tmpfs the test mounts, so it needs root (and a kernel that lets it mount);
elsewhere it skips with that reason, reported as a proof that did not run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_corpus import snapshot

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.errors import OutputWriteError

pytestmark = pytest.mark.proof("disk-full")


@pytest.fixture
def small_fs(tmp_path: Path):
    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("the disk-full test mounts a small tmpfs, which needs root")
        mnt = tmp_path / f"fs-{size}"
        mnt.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    mounted: list[Path] = []
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


OPTIONS = CalibrateOptions(num_samples=4, max_seq_len=32, overwrite=True)


def test_too_small_is_refused_before_calibrating(small_fs, tiny_llama_master, short_dataset):
    mnt = small_fs("256k")  # the weights are copied (another filesystem): ~0.7 MB do not fit
    stages = []
    with pytest.raises(OutputWriteError) as err:
        calibrate(
            tiny_llama_master,
            str(short_dataset),
            mnt / "out",
            OPTIONS,
            progress=lambda p: stages.append(p.stage),
        )
    assert stages == []  # refused in the checks, before the dataset or the model was read
    assert (
        f"not enough space for {mnt / 'out'}" in err.value.message
        and "hard links do not work" in err.value.message
    )
    assert err.value.hint and os.listdir(mnt) == []


def test_disk_full_mid_write_keeps_the_old_output(
    small_fs, tiny_llama_master, short_dataset, handmade_master
):
    mnt = small_fs("2m")
    out = mnt / "out"
    shutil.copytree(handmade_master, out)
    old = snapshot(out)
    filler = mnt / "filler"

    def fill_at_write(p) -> None:  # after the checks passed: another process fills the disk
        if p.stage == "write":
            free = shutil.disk_usage(mnt).free
            with open(filler, "wb") as f:
                f.write(b"\0" * max(free - (64 << 10), 0))

    with pytest.raises(OutputWriteError) as err:
        calibrate(tiny_llama_master, str(short_dataset), out, OPTIONS, progress=fill_at_write)
    assert "No space left on device" in err.value.message and str(out) in err.value.message
    assert "filesystem is full" in err.value.hint
    assert snapshot(out) == old
    assert sorted(os.listdir(mnt)) == ["filler", "out"]  # the staging directory is gone

    filler.unlink()  # space again: the same run now succeeds
    result = calibrate(tiny_llama_master, str(short_dataset), out, OPTIONS)
    assert result.output == str(out) and snapshot(out) != old
    assert sorted(os.listdir(mnt)) == ["out"]
