"""Run one calibrate and count the files kvcalib's own code opens (for tests/calibrate/test_reads.py).

    python count_reads.py MODEL DATASET OUT [ENGINE]

An audit hook sees every `open`; an open counts as kvcalib's when the innermost frame outside
the standard library is in the kvcalib package (transformers' and safetensors' own reads do
not count). Prints {path: opens} for the model directory's files as JSON on the last line.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate

MODEL, DATASET, OUT = (Path(a).resolve() for a in sys.argv[1:4])
ENGINE = sys.argv[4] if len(sys.argv) > 4 else "native"
PACKAGE = str(Path(__file__).resolve().parents[2] / "kvcalib")
STDLIB = sysconfig.get_paths()["stdlib"]
opens: Counter[str] = Counter()


def hook(event: str, args: tuple) -> None:
    if event != "open" or not isinstance(args[0], (str, Path)):
        return
    path = str(args[0])
    if not path.startswith(str(MODEL)):
        return
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(STDLIB) or "<frozen" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        opens[Path(path).name] += 1


sys.addaudithook(hook)
calibrate(MODEL, str(DATASET), OUT, CalibrateOptions(num_samples=8, max_seq_len=32, engine=ENGINE))
print(json.dumps(dict(opens)))
