"""Memory: how much a run may use, how much the weights need, and so which engine runs.

`available_memory` is the tightest of the limits a process really meets: the kernel's
MemAvailable, the cgroup memory limit (v1 or v2) minus what the group already uses, and the
soft RLIMIT_AS / RLIMIT_DATA minus what this process already maps. `weight_bytes` sums the
safetensors headers (no tensor is read) in the calibration dtype. `choose_engine` streams
layer by layer when the in-memory engine would not fit, and says why.
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import DTYPE_SIZES, scan_checkpoint
from .errors import OutOfMemoryError

GiB = 1 << 30
# The in-memory engine needs the weights plus activations, the loader's transient copies and
# the Python/torch runtime: stream when weights * HEADROOM do not fit.
HEADROOM = 1.2
_NO_LIMIT = 1 << 60  # cgroup v1 writes 2^63 - 4096 for "no limit"
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory bound found, in bytes, and which one it is."""

    available: int
    source: str  # "MemAvailable" | "cgroup memory limit" | "RLIMIT_AS" | "RLIMIT_DATA" | "cuda:N free memory"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineChoice:
    """The engine that will run, and the numbers that chose it."""

    engine: str
    weight_bytes: int
    copies: int  # processes on this host that each load the weights
    limit: MemoryLimit | None
    reason: str | None  # set when "auto" chose streaming

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "weight_bytes": self.weight_bytes, "copies": self.copies,
                "limit": self.limit.to_dict() if self.limit else None, "reason": self.reason}


def weight_bytes(model_dir: Path, dtype: torch.dtype | None) -> int:
    """Bytes the checkpoint's tensors take in `dtype` (floating tensors; others as stored)."""
    files = scan_checkpoint(model_dir)
    size = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    total = 0
    for header in files.headers.values():
        for info in header.tensors.values():
            if size is not None and info.dtype in _FLOAT_DTYPES:
                total += info.nbytes // DTYPE_SIZES[info.dtype] * size
            else:
                total += info.nbytes
    return total


def _stored_dtypes(model_dir: Path) -> str:
    """The checkpoint's floating dtypes as torch names ("bfloat16"), for messages."""
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
    stored = {names[info.dtype] for header in scan_checkpoint(model_dir).headers.values()
              for info in header.tensors.values() if info.dtype in names}
    return "/".join(sorted(stored)) or "the stored dtypes"


def available_memory(device: torch.device | None = None) -> MemoryLimit:
    """The tightest of MemAvailable, the cgroup limit, the rlimits (and free memory on a CUDA device)."""
    limits: list[MemoryLimit] = []
    meminfo = _meminfo()
    if "MemAvailable" in meminfo:
        limits.append(MemoryLimit(meminfo["MemAvailable"], "MemAvailable"))
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        limits.append(MemoryLimit(cgroup, "cgroup memory limit"))
    status = proc_status()
    for name, used_key in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _hard = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY and soft < _NO_LIMIT:
            limits.append(MemoryLimit(max(0, soft - status.get(used_key, 0)), name))
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        limits.append(MemoryLimit(int(free), f"{device} free memory"))
    if not limits:
        return MemoryLimit(_NO_LIMIT, "unknown")
    return min(limits, key=lambda limit: limit.available)


def choose_engine(requested: str, model_dir: Path, dtype: torch.dtype | None, device: torch.device,
                  copies: int = 1) -> EngineChoice:
    """`requested` unless it is "auto": then "stream" if the weights would not fit, else "native"."""
    if requested != "auto":
        return EngineChoice(requested, 0, copies, None, None)
    needed = weight_bytes(model_dir, dtype)
    in_dtype = str(dtype).removeprefix("torch.") if dtype is not None else _stored_dtypes(model_dir)
    host = available_memory()
    limits = [host]
    if device.type == "cuda":  # the in-memory engine loads on the host, then moves to the GPU
        limits.append(available_memory(device))
    for limit in limits:
        per_process = limit.available if limit.source.startswith("cuda") else limit.available // max(copies, 1)
        if needed * HEADROOM > per_process:
            who = f" per process ({copies} on this host)" if copies > 1 and not limit.source.startswith("cuda") else ""
            reason = (
                f"streaming the model layer by layer: its weights need {needed / GiB:.2f} GiB"
                f" in {in_dtype} (x{HEADROOM} headroom) but only "
                f"{per_process / GiB:.2f} GiB is available{who} ({limit.source})"
            )
            return EngineChoice("stream", needed, copies, limit, reason)
    return EngineChoice("native", needed, copies, host, None)


def _read_kib_fields(path: str, prefix: str = "") -> dict[str, int]:
    """`Name:  123 kB` lines of a /proc file (fields starting with `prefix`), in bytes."""
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name.startswith(prefix) and parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _meminfo() -> dict[str, int]:
    return _read_kib_fields("/proc/meminfo")


def proc_status() -> dict[str, int]:
    """VmSize, VmData, VmRSS, VmHWM, ... of this process in bytes."""
    return _read_kib_fields("/proc/self/status", prefix="Vm")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> int | None:
    """limit - usage of this process's memory cgroup (v2, else v1); None without a limit."""
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = Path("/sys/fs/cgroup")
    for entry in entries:
        _id, controllers, path = entry.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            candidates = [(root / rel / "memory.max", root / rel / "memory.current"),
                          (root / "memory.max", root / "memory.current")]
        elif "memory" in controllers.split(","):
            base = root / "memory"
            candidates = [(base / rel / "memory.limit_in_bytes", base / rel / "memory.usage_in_bytes"),
                          (base / "memory.limit_in_bytes", base / "memory.usage_in_bytes")]
        else:
            continue
        for limit_path, usage_path in candidates:
            limit = _read_int(limit_path)
            if limit is not None and limit < _NO_LIMIT:
                return max(0, limit - (_read_int(usage_path) or 0))
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (VmHWM)."""
    return proc_status().get("VmHWM", 0)


def out_of_memory_error(exc: BaseException, engine: str, device: torch.device) -> OutOfMemoryError | None:
    """A clear error for an allocation that failed (host or GPU); None for any other exception."""
    text = str(exc)
    oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "allocate memory" in text or "out of memory" in text.lower()
    if not oom:
        return None
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    hint = ("rerun with --stream-layers (one decoder layer in memory at a time)" if engine != "stream"
            else "lower --batch-size or --max-seq-len, or free memory on this machine")
    return OutOfMemoryError(f"ran out of memory on {device} calibrating with the {engine} engine ({first_line})", hint=hint)
