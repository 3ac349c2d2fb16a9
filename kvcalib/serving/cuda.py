"""`serve-check --device cuda`: a CUDA device and a CUDA build of vLLM, asked of the vLLM interpreter itself."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path

from kvcalib.core.errors import DeviceError, UsageError, VllmNotFoundError

__all__ = ["CUDA_PROBE_TIMEOUT_S", "check_cuda"]

CUDA_PROBE_TIMEOUT_S = 120.0
_CUDA_PROBE = """
import json
out = {}
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
    out["devices"] = torch.cuda.device_count() if torch.version.cuda else 0
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    from vllm.platforms import current_platform
    out["platform"] = current_platform.device_type
except Exception as exc:
    out["platform_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
_HINT = "install a CUDA build of vLLM (pip install vllm) on a host with an NVIDIA GPU, or pass its --vllm-python"


def check_cuda(python: Path, env: Mapping[str, str], tp: int | None) -> int:
    """The CUDA devices `python`'s torch sees (>= 1, >= tp); DeviceError or VllmNotFoundError saying why not."""
    try:
        proc = subprocess.run(
            [str(python), "-c", _CUDA_PROBE],
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=CUDA_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        raise VllmNotFoundError(
            f"cannot run {python} to look for CUDA", hint="pass a working --vllm-python"
        ) from None
    if "torch_error" in found:
        raise VllmNotFoundError(
            f"{python} cannot import torch ({found['torch_error']})", hint=_HINT
        )
    if not found.get("torch_cuda"):
        raise DeviceError(
            f"the torch in {python}'s environment is a CPU build: no CUDA, so no GPU vLLM",
            hint=_HINT,
        )
    if found.get("platform") != "cuda":
        why = found.get("platform_error") or f"its platform is {found.get('platform')!r}"
        raise VllmNotFoundError(
            f"the vLLM in {python}'s environment is not a CUDA build ({why})", hint=_HINT
        )
    devices, visible = int(found.get("devices") or 0), env.get("CUDA_VISIBLE_DEVICES")
    if devices < 1:
        raise DeviceError(
            f"no CUDA device is visible to {python}"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible else ""),
            hint="run on a host with an NVIDIA GPU and its driver, or fix CUDA_VISIBLE_DEVICES",
        )
    if tp is not None and tp > devices:
        raise UsageError(
            f"--tp {tp} needs {tp} GPUs; {python} sees {devices}",
            hint=f"pass --tp {devices} or less, or make more GPUs visible",
        )
    return devices
