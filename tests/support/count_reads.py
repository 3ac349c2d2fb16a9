"""Count the files kvcalib's own code opens (for tests/calibrate/test_reads.py).

An audit hook sees every `open`; an open counts as kvcalib's when the innermost frame outside the standard
library is in the kvcalib package (transformers' and safetensors' own reads do not count). An audit hook
cannot be removed, so one is added per process and counts only inside `count_opens`.
"""

from __future__ import annotations

import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kvcalib

PACKAGE = str(Path(kvcalib.__file__).resolve().parent)
STDLIB = sysconfig.get_paths()["stdlib"]
_counting: list[tuple[str, Counter[str]]] = []  # (the directory watched, its opens) while counting


def _hook(event: str, args: tuple) -> None:
    if not _counting or event != "open" or not isinstance(args[0], (str, Path)):
        return
    directory, opens = _counting[-1]
    path = str(args[0])
    if not path.startswith(directory):
        return
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(STDLIB) or "<frozen" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        opens[Path(path).name] += 1


sys.addaudithook(_hook)


@contextmanager
def count_opens(directory: Path) -> Iterator[Counter[str]]:
    """{file name: opens by kvcalib's code} of the files under `directory`, while the block runs."""
    opens: Counter[str] = Counter()
    _counting.append((str(directory.resolve()), opens))
    try:
        yield opens
    finally:
        _counting.pop()
