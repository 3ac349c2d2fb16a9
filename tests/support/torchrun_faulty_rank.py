"""`kvcalib calibrate` under torchrun with rank 1 failing mid-calibration, for test_scale.py and test_output_step.py.

    torchrun --nproc-per-node 2 tests/support/torchrun_faulty_rank.py raise|die|step|step-oom CALIBRATE-ARGS...

`raise`: rank 1's engine raises a KvcalibError (as a full disk or a bad GPU would);
`die`: rank 1 exits at once without a word (as a process killed by the OOM killer);
`step`: rank 1 raises a RuntimeError in the whole-model step, printing when to stderr ("failing at SECONDS");
`step-oom`: rank 1 runs out of memory (MemoryError) in the whole-model step.
Rank 0 works normally. None may leave rank 0 waiting; only step-oom writes.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from kvcalib.calibration import output
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


def faulty_step(self, *args):
    if self.rank == 1:
        if MODE == "step-oom":
            raise MemoryError("rank one's step needs more memory")
        print(f"failing at {time.time()}", file=sys.stderr, flush=True)
        raise RuntimeError("rank one's step broke")
    return run(self, *args)


if __name__ == "__main__":
    if MODE.startswith("step"):
        run, output._Scorer.run = output._Scorer.run, faulty_step
    else:
        ENGINES["native"] = faulty_engine  # what "auto" picks for a small model
    main()
