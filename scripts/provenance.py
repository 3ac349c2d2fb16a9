"""The line a benchmark prints above its table: the command, the commit, the date and the CPU.

scripts/BENCHMARKS.md quotes it with each table, so a figure always says where it came from:

    from provenance import provenance  # scripts/ is on sys.path when a script there runs
    print(provenance())
    # `OMP_NUM_THREADS=1 python scripts/bench_search.py --reps 2`; commit 80d1112; 2026-12-03;
    # Intel(R) Xeon(R) Processor (avx2 avx512f avx512_bf16 amx_bf16 amx_tile), 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
)  # the ones that decide kvcalib's compute path


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    except OSError:  # no git on this machine
        return ""


def cpu() -> str:
    """The CPU's model name and which of FLAGS it has, from /proc/cpuinfo, and its core count."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "CPU not recorded",
    )
    flags = next(
        (
            set(line.split(":", 1)[1].split())
            for line in info.splitlines()
            if line.startswith("flags")
        ),
        set(),
    )
    has = " ".join(f for f in FLAGS if f in flags) or "none of " + " ".join(FLAGS)
    return f"{model} ({has}), {os.cpu_count()} cores"


def provenance(argv: list[str] | None = None) -> str:
    """`COMMAND`; commit HASH[ (kvcalib/ modified)]; DATE; CPU. COMMAND is this process's (sys.argv by default),
    the script named from the repository root, with OMP_NUM_THREADS in front when it is set."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    name = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else argv[0]
    threads = os.environ.get("OMP_NUM_THREADS")
    command = (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(
        ["python", name, *argv[1:]]
    )
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    modified = " (kvcalib/ modified)" if _git("status", "--porcelain", "--", "kvcalib") else ""
    return f"`{command}`; commit {commit}{modified}; {datetime.date.today()}; {cpu()}"


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(provenance())
