"""Memory: how much a run may use (MemAvailable, the cgroup limit less its usage, the soft RLIMIT_AS / RLIMIT_DATA
less what is mapped), how much the weights need (from the safetensors headers), and so which engine runs."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcalib.core.checkpoint import Checkpoint
from kvcalib.core.errors import OutOfMemoryError

__all__ = [
    "GiB",
    "HEADROOM",
    "EngineChoice",
    "MemoryLimit",
    "available_memory",
    "choose_engine",
    "out_of_memory_error",
    "peak_rss_bytes",
    "proc_status",
    "release_free_memory",
    "weight_bytes",
]

GiB = 1 << 30
HEADROOM = 1.2  # weights plus activations, the loader's copies, the runtime: stream when weights * HEADROOM do not fit
_NO_LIMIT = 1 << 60  # cgroup v1 writes 2^63 - 4096 for "no limit"
PROC, SYS = Path("/proc"), Path("/sys")


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory bound found, in bytes, and which one it is."""

    available: int
    source: str  # "MemAvailable" | "cgroup memory limit" | "RLIMIT_AS" | "RLIMIT_DATA" | "cuda:N free memory"


@dataclass(frozen=True)
class EngineChoice:
    """The engine that will run, and the numbers that chose it."""

    engine: str
    limit: MemoryLimit | None  # the host limit that was compared (None when the engine was named)
    reason: str | None  # set when "auto" chose streaming


def weight_bytes(checkpoint: Checkpoint | Path, dtype: torch.dtype | None) -> int:
    """Bytes the checkpoint's tensors take in `dtype` (floating tensors; others as stored)."""
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint)
    return checkpoint.weight_bytes(
        torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    )


def available_memory(
    device: torch.device | None = None, proc: Path = PROC, sys: Path = SYS
) -> MemoryLimit:
    """The tightest of MemAvailable, the cgroup limit, the rlimits (and a CUDA device's free memory)."""
    found = (
        (_read_kib_fields(proc / "meminfo").get("MemAvailable"), "MemAvailable"),
        (_cgroup_headroom(proc, sys), "cgroup memory limit"),
    )
    limits = [
        MemoryLimit(available, source) for available, source in found if available is not None
    ]
    status = proc_status(proc)
    for name, used_key in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _hard = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY and soft < _NO_LIMIT:
            limits.append(MemoryLimit(max(0, soft - status.get(used_key, 0)), name))
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        limits.append(MemoryLimit(int(free), f"{device} free memory"))
    return min(limits, key=lambda limit: limit.available, default=MemoryLimit(_NO_LIMIT, "unknown"))


def choose_engine(
    requested: str,
    checkpoint: Checkpoint,
    dtype: torch.dtype | None,
    device: torch.device,
    copies: int,
    host: MemoryLimit,
) -> EngineChoice:
    """`requested` unless "auto": then "stream" if the weights would not fit in `host` (per copy)."""
    if requested != "auto":
        return EngineChoice(requested, None, None)
    needed = weight_bytes(checkpoint, dtype)
    in_dtype = (
        str(dtype).removeprefix("torch.")
        if dtype is not None
        else "/".join(checkpoint.stored_float_dtypes()) or "the stored dtypes"
    )
    limits = [(host, max(copies, 1))]
    if device.type == "cuda":  # the in-memory engine loads on the host, then moves to the GPU
        limits.append((available_memory(device), 1))
    for limit, shared in limits:
        if needed * HEADROOM > limit.available // shared:
            who = f" per process ({copies} on this host)" if shared > 1 else ""
            return EngineChoice(
                "stream",
                limit,
                f"streaming the model layer by layer: its weights need {needed / GiB:.2f} GiB in {in_dtype} "
                f"(x{HEADROOM} headroom) but only {limit.available // shared / GiB:.2f} GiB is available{who} "
                f"({limit.source})",
            )
    return EngineChoice("native", host, None)


def _read_kib_fields(path: Path) -> dict[str, int]:
    """`Name:  123 kB` lines of a /proc file, in bytes."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def proc_status(proc: Path = PROC) -> dict[str, int]:
    """VmSize, VmData, VmRSS, VmHWM, ... of this process in bytes."""
    return _read_kib_fields(proc / "self" / "status")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom(proc: Path, sys: Path) -> int | None:
    """limit - usage of this process's memory cgroup (v2, else v1); None without a limit."""
    try:
        entries = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in entries:
        _id, controllers, path = entry.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            root, limit_name, usage_name = sys / "fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_name = sys / "fs/cgroup/memory", "memory.limit_in_bytes"
            usage_name = "memory.usage_in_bytes"
        else:
            continue
        for base in (root / path.lstrip("/"), root):
            limit = _read_int(base / limit_name)
            if limit is not None and limit < _NO_LIMIT:
                return max(0, limit - (_read_int(base / usage_name) or 0))
    return None


def peak_rss_bytes() -> int:
    return proc_status().get("VmHWM", 0)


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim(0)`); False without glibc (musl, macOS,
    Windows)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError, TypeError):
        return False
    return True


def out_of_memory_error(
    exc: BaseException, engine: str, device: torch.device
) -> OutOfMemoryError | None:
    """A clear error for an allocation that failed (host or GPU); None for any other exception."""
    text = str(exc)
    if not (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "allocate memory" in text
        or "out of memory" in text.lower()
    ):
        return None
    first_line = (text.strip() or type(exc).__name__).splitlines()[0]
    return OutOfMemoryError(
        f"ran out of memory on {device} calibrating with the {engine} engine ({first_line})",
        hint="lower --batch-size or --max-seq-len, or free memory on this machine"
        if engine == "stream"
        else "rerun with --stream-layers (one decoder layer in memory at a time)",
    )
