"""Putting a new checkpoint at OUT so that no interruption, at any instant, loses the old one.

A run writes in a sibling PARENT/.OUT.kvcalib-XXXXXXXX/: the marker `.kvcalib-staging` ({"output", "pid", "host",
"started"}), checkpoint/, and in the fallback old/ (the previous OUT). Publishing swaps checkpoint/ and OUT with
`renameat2(RENAME_EXCHANGE)` (Linux 3.15+, glibc 2.28+), else renames OUT to old/ and checkpoint/ to OUT. The marker
goes last; `recover` (before every calibration) restores or removes what a killed run left. Signals are deferred."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcalib.core.errors import OutputExistsError

__all__ = ["MARKER", "Staging", "discard", "publish", "recover", "siblings", "stage"]

MARKER = ".kvcalib-staging"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Staging:
    root: Path
    output: Path

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def old(self) -> Path:
        return self.root / "old"


def _prefix(output: Path) -> str:
    return f".{output.name}.kvcalib-"


def stage(output: Path) -> Staging:
    """A new staging sibling of `output` (its parent must exist), with its marker and an empty checkpoint/."""
    output = Path(output)
    root = Path(tempfile.mkdtemp(prefix=_prefix(output), dir=output.parent))
    staging = Staging(root, output)
    try:
        os.chmod(root, 0o755)  # mkdtemp makes it private; the published checkpoint is not
        marker = {
            "output": output.name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
        }
        (root / MARKER).write_text(json.dumps(marker) + "\n")
        staging.checkpoint.mkdir()
    except BaseException:
        discard(staging)
        raise
    return staging


def publish(staging: Staging) -> None:
    """Put staging's checkpoint at OUT (replacing an old OUT atomically where the OS can), then discard the rest."""
    with _signals_deferred():
        if os.path.lexists(staging.output):
            try:
                _rename_exchange(staging.checkpoint, staging.output)
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EPERM):
                    raise
                os.rename(staging.output, staging.old)  # the fallback: see the module docstring
                os.rename(staging.checkpoint, staging.output)
        else:
            os.rename(staging.checkpoint, staging.output)
        discard(staging)


def discard(staging: Staging) -> bool:
    """Remove a staging sibling; first put old/ back at OUT if OUT is gone. True if it restored OUT."""
    restored = False
    with _signals_deferred():
        if staging.old.is_dir() and not os.path.lexists(staging.output):
            os.rename(staging.old, staging.output)
            restored = True
        for child in sorted(staging.root.iterdir()) if staging.root.is_dir() else ():
            if (
                child.name != MARKER
            ):  # the marker goes last: until then the sibling stays recognisable
                shutil.rmtree(
                    child
                ) if child.is_dir() and not child.is_symlink() else child.unlink()
        (staging.root / MARKER).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            staging.root.rmdir()
    return restored


def siblings(output: Path) -> list[Path]:
    """Staging siblings of `output` that kvcalib made: the name, and the marker (or nothing at all) inside."""
    return [
        entry
        for entry in _named(Path(output))
        if (entry / MARKER).is_file() or not any(entry.iterdir())
    ]


def _named(output: Path) -> list[Path]:
    found = output.parent.glob(_prefix(output) + "*") if output.parent.is_dir() else ()
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def recover(output: Path) -> list[str]:
    """Restore or remove what killed runs left next to `output` (unmarked: only reported); refuse a live writer."""
    output = Path(output)
    marked = siblings(output)
    notes = [
        f"{path} next to {output} looks like a leftover of an earlier kvcalib run, without the marker "
        "that would make it safe to remove: left alone; delete it if nothing uses it"
        for path in _named(output)
        if path not in marked
    ]
    for root in marked:
        try:  # (pid, host, started) from the marker; None if unreadable (a run killed while writing it)
            marker = json.loads((root / MARKER).read_text())
            owner = int(marker["pid"]), str(marker["host"]), float(marker["started"])
        except (OSError, ValueError, KeyError, TypeError):
            owner = None
        if owner is not None and _alive(*owner):
            raise OutputExistsError(
                f"another kvcalib (pid {owner[0]}) is writing {output} (its staging directory {root})",
                hint="wait for it to finish, or stop it; two runs must not write one output",
            )
        who = f"pid {owner[0]}" if owner else "a process killed as it began"
        done = (
            f"restored the previous {output} from {root.name}"
            if discard(Staging(root, output))
            else f"removed {root.name} next to {output}"
        )
        notes.append(f"{done}, left by an interrupted run ({who})")
    return notes


def _alive(pid: int, host: str, started: float) -> bool:
    """Whether the marker's writer still runs. On another host it cannot be known: assume it does."""
    if host != socket.gethostname():
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:  # when it began, from /proc: a process that began after the marker reuses the pid
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") <= started + 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return True


def _rename_exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); OSError(ENOSYS) where it does not exist."""
    func = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP (Python handlers swapped) until the block ends, then act on the first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in _DEFERRED}
    for signum in _DEFERRED:
        signal.signal(signum, lambda number, frame: pending.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            handler = previous[pending[0]]
            if callable(handler):
                handler(pending[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(pending[0])
