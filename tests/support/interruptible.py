"""The `kvcalib` CLI, stopping at one point of its work and saying so, for the interrupt tests.

    python interruptible.py POINT -- COMMAND ARGS...

POINT is where it prints "AT POINT" on stdout and sleeps PAUSE_S seconds (the test sends its
signal then; without one the run goes on):

- observe    before the model runs over the data
- write      in the staging directory: weights linked, no scales yet
- publish    staging complete and validated, just before the atomic exchange with OUT
- exchanged  right after the exchange: OUT is new, the old checkpoint still in the sibling
- between    the fallback publish (no renameat2): OUT moved into the sibling, the new one not yet in place
- eval       (kvcalib eval) before the model is loaded
- validate   (kvcalib validate) before the safetensors headers are read
- tasks      (kvcalib eval-tasks) inside lm-eval's scoring, the model loaded and the task data read

Everything else is the real CLI, run as `kvcalib` runs it.
"""

from __future__ import annotations

import errno
import os
import sys
import time

PAUSE_S = 2.0


def pause(point: str) -> None:
    sys.stdout.write(f"AT {point}\n")
    sys.stdout.flush()
    time.sleep(PAUSE_S)


def main() -> None:
    point = sys.argv[1]
    assert sys.argv[2] == "--"
    sys.argv = ["kvcalib", *sys.argv[3:]]
    from kvcalib.calibration import pipeline, publish, writer
    from kvcalib.evaluation import pipeline as eval_pipeline
    from kvcalib.validation import pipeline as validate_pipeline

    if point == "observe":
        real_observe = pipeline._observe
        pipeline._observe = lambda *a: (pause(point), real_observe(*a))[1]
    elif point == "write":
        real_write = writer._write_files
        writer._write_files = lambda *a: (pause(point), real_write(*a))[1]
    elif point == "publish":
        real_exchange = publish._rename_exchange
        publish._rename_exchange = lambda *a: (pause(point), real_exchange(*a))[1]
    elif point == "exchanged":
        real_exchange = publish._rename_exchange
        publish._rename_exchange = lambda *a: (real_exchange(*a), pause(point))[0]
    elif point == "between":

        def no_exchange(*a):
            raise OSError(errno.EINVAL, "no RENAME_EXCHANGE here")

        publish._rename_exchange = no_exchange
        real_rename = os.rename

        def rename(src, dst, *a, **k):
            real_rename(src, dst, *a, **k)
            if os.path.basename(dst) == "old":
                pause(point)

        os.rename = rename
    elif point == "eval":
        real_load = eval_pipeline.load_model
        eval_pipeline.load_model = lambda *a, **k: (pause(point), real_load(*a, **k))[1]
    elif point == "validate":
        real_scan = validate_pipeline.scan_for_validation
        validate_pipeline.scan_for_validation = lambda *a: (pause(point), real_scan(*a))[1]
    elif point == "tasks":
        from kvcalib.evaluation.harness import KvcalibLM

        real_score = KvcalibLM._loglikelihood_tokens
        KvcalibLM._loglikelihood_tokens = lambda *a, **k: (pause(point), real_score(*a, **k))[1]
    else:
        raise SystemExit(f"unknown point {point}")
    from kvcalib.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
