"""Paths a user hands kvcalib: files that must be regular files (a FIFO or device is refused before it can block),
outputs that must not overlap inputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvcalib.core.errors import CheckpointNotFoundError, CheckpointReadError, KvcalibError

__all__ = ["overlapping", "require_regular_file"]

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def require_regular_file(
    path: Path,
    what: str,
    *,
    error: type[KvcalibError] = CheckpointReadError,
    missing: type[KvcalibError] = CheckpointNotFoundError,
    hint: str | None = None,
) -> Path:
    """`path` if it is a regular file (after symlinks), opening nothing; `error` or `missing` otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise missing(f"{what} not found: {path}", hint=hint or "check the path") from None
    # a permission-denied directory on the way, a loop of links, a name too long
    except OSError as exc:
        raise error(
            f"cannot read {what} {path}: {exc.strerror}", hint="check the path and its permissions"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{what} {path} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, not a regular "
            "file",
            hint=hint or f"pass the {what} itself, as a regular file",
        )
    return path


def overlapping(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are the same path or one is inside the other, symlinks resolved."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)
