"""Is this a Neuron host, and which chip? `neuron-ls --json-output` lists the devices; the chip family is the
instance type's prefix (trn2, trn3, ...) from the driver's sysfs, else plain `neuron-ls`'s header, unless
NEURON_PLATFORM_TARGET_OVERRIDE (which the vLLM plugin obeys) says otherwise. Without a working driver `neuron-ls`
prints one logfmt line on stderr (`level=fatal msg="..."`), quoted in the error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from kvcalib.core.errors import DeviceError
from kvcalib.core.fp8 import TARGETS

__all__ = ["neuron_cores", "parse_neuron_ls_json"]

NEURON_TOOLS_DIR = Path("/opt/aws/neuron/bin")
SYSFS_ARCHITECTURE = Path("devices/virtual/neuron_device/neuron0/info/architecture")
TARGET_OVERRIDE_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
TOOL_TIMEOUT_S = 60.0
_INSTANCE_TYPE_LINE = re.compile(r"instance-type:\s*([A-Za-z0-9.\-]+)")
_HINT = "run on a Trainium instance with the Neuron driver and tools (aws-neuronx-tools), or use --device cpu"


def parse_neuron_ls_json(text: str) -> int:
    """The NeuronCores over the devices `neuron-ls --json-output` lists; DeviceError when it is not that shape."""
    try:
        entries = json.loads(text)
        cores = [entry["nc_count"] for entry in entries]
        if isinstance(entries, list) and all(type(count) is int for count in cores):
            return sum(cores)
    except (ValueError, TypeError, KeyError):
        pass
    raise DeviceError(
        "neuron-ls --json-output did not print a JSON array of devices, each with an integer nc_count: "
        f"{text[:200]!r}",
        hint=_HINT,
    )


def _run_tool(argv: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            env=dict(env),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DeviceError(f"cannot run {argv[0]}: {err}", hint=_HINT) from None


def neuron_cores(
    env: Mapping[str, str],
    device: str,
    sysfs_root: Path = Path("/sys"),
    dev_root: Path = Path("/dev"),
) -> int:
    """The NeuronCores of this host, whose chip family must be `device`; DeviceError saying what was looked for."""
    neuron_ls = shutil.which("neuron-ls", path=f"{env.get('PATH', os.defpath)}:{NEURON_TOOLS_DIR}")
    if neuron_ls is None:
        nodes = len(list(dev_root.glob("neuron*")))
        seen = f"{nodes} /dev/neuron* node(s)" if nodes else "no /dev/neuron* devices"
        raise DeviceError(
            f"no Neuron tools: neuron-ls is neither on PATH nor in {NEURON_TOOLS_DIR} ({seen})",
            hint=_HINT + "; if the tools are installed elsewhere, put that directory on PATH",
        )
    proc = _run_tool([neuron_ls, "--json-output"], env)
    if proc.returncode != 0 or not proc.stdout.strip():
        said = proc.stderr.strip().rsplit("\n", 1)[
            -1
        ]  # without a driver: level=fatal msg="..." error="..."
        raise DeviceError(
            f"no Neuron devices: {neuron_ls} --json-output exited {proc.returncode} ({said or 'no output'})",
            hint="the Neuron driver is not loaded or this is not a Neuron instance; "
            "check `lsmod | grep neuron` and /dev/neuron*, or use --device cpu",
        )
    cores = parse_neuron_ls_json(proc.stdout)
    if not cores:
        raise DeviceError(f"no Neuron devices: {neuron_ls} --json-output listed none", hint=_HINT)
    try:
        path = sysfs_root / SYSFS_ARCHITECTURE / "instance_type"
        instance_type, source = path.read_text().strip() or None, "sysfs"
    except OSError:
        instance_type = None
    if instance_type is None:
        proc = _run_tool([neuron_ls], env)
        match = _INSTANCE_TYPE_LINE.search(proc.stdout) if proc.returncode == 0 else None
        instance_type, source = match and match.group(1), "neuron-ls"
    family = env.get(TARGET_OVERRIDE_ENV)
    if family:
        source = TARGET_OVERRIDE_ENV
    elif instance_type:
        family = instance_type.split(".")[0]
    else:
        raise DeviceError(
            f"cannot tell the Neuron chip family: no instance_type in {sysfs_root / SYSFS_ARCHITECTURE} "
            "and no `instance-type:` line from neuron-ls",
            hint=f"set {TARGET_OVERRIDE_ENV}=trn2 or trn3 (the vLLM plugin obeys it too)",
        )
    if family != device:
        where = f"{instance_type} " if instance_type else ""
        raise DeviceError(
            f"this host is {family} ({where}from {source}), not {device}",
            hint=f"pass --device {family}"
            if family in TARGETS and TARGETS[family].neuron
            else "serve-check supports trn2 and trn3 Neuron hosts, or --device cpu",
        )
    return cores
