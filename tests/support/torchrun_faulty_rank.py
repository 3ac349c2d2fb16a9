"""`kvcalib calibrate` under torchrun with rank 1 failing mid-calibration, for test_scale.py.

    torchrun --nproc-per-node 2 tests/support/torchrun_faulty_rank.py raise|die CALIBRATE-ARGS...

`raise`: rank 1's engine raises a KvcalibError (as a full disk or a bad GPU would);
`die`: rank 1 exits at once without a word (as a process killed by the OOM killer).
Rank 0 works normally. Neither may leave rank 0 waiting.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from kvcalib.calibration.native import native_engine
from kvcalib.calibration.pipeline import ENGINES
from kvcalib.cli import main
from kvcalib.core.errors import CalibrationError

MODE = sys.argv.pop(1)


def faulty_engine(inputs):
    if dist.get_rank() == 1:
        if MODE == "die":
            os._exit(3)
        raise CalibrationError("rank one's scratch disk is full")
    return native_engine(inputs)


if __name__ == "__main__":
    ENGINES["native"] = faulty_engine  # what "auto" picks for a small model
    main()
