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
from dataclasses import dataclass, field
from pathlib import Path

from kvcalib.core.errors import DeviceError
from kvcalib.core.fp8 import TARGETS

__all__ = [
    "NEURON_TOOLS_DIR",
    "NeuronDevice",
    "NeuronHost",
    "SYSFS_ARCHITECTURE",
    "TARGET_OVERRIDE_ENV",
    "TOOL_TIMEOUT_S",
    "detect_neuron_host",
    "find_neuron_ls",
    "parse_logfmt",
    "parse_neuron_ls_json",
    "require_family",
]

NEURON_TOOLS_DIR = Path("/opt/aws/neuron/bin")
SYSFS_ARCHITECTURE = Path("devices/virtual/neuron_device/neuron0/info/architecture")
TARGET_OVERRIDE_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
TOOL_TIMEOUT_S = 60.0
_INSTANCE_TYPE_LINE = re.compile(r"instance-type:\s*([A-Za-z0-9.\-]+)")
_LOGFMT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_HINT = "run on a Trainium instance with the Neuron driver and tools (aws-neuronx-tools), or use --device cpu"


@dataclass(frozen=True)
class NeuronDevice:
    """One entry of `neuron-ls --json-output`."""

    index: int
    nc_count: int
    memory_size: int  # bytes
    bdf: str | None = None


@dataclass(frozen=True)
class NeuronHost:
    family: str  # "trn2", "trn3", "trn1", "inf2", ...
    instance_type: str | None
    family_source: str  # where the family was read: sysfs, neuron-ls, or the override variable
    devices: tuple[NeuronDevice, ...] = field(default_factory=tuple)
    neuron_ls: str = ""

    @property
    def num_cores(self) -> int:
        return sum(d.nc_count for d in self.devices)


def find_neuron_ls(path_env: str | None) -> str | None:
    fallback = NEURON_TOOLS_DIR / "neuron-ls"
    return shutil.which("neuron-ls", path=path_env) or (
        str(fallback) if os.access(fallback, os.X_OK) else None
    )


def parse_logfmt(line: str) -> dict[str, str]:
    """`level=fatal msg="Failed ..." error="..."` -> {"level": "fatal", "msg": "Failed ...", ...}."""
    fields = {}
    for key, value in _LOGFMT_FIELD.findall(line):
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = value[1:-1]
        fields[key] = value
    return fields


def parse_neuron_ls_json(text: str) -> tuple[NeuronDevice, ...]:
    """The devices in `neuron-ls --json-output`; DeviceError when it is not that shape."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as err:
        raise DeviceError(
            f"neuron-ls --json-output printed something that is not JSON ({err})", hint=_HINT
        ) from None
    if not isinstance(entries, list):
        raise DeviceError(
            "neuron-ls --json-output did not print a JSON array of devices", hint=_HINT
        )
    devices = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("nc_count"), int):
            raise DeviceError(
                f"neuron-ls --json-output: device entry {position} has no integer nc_count",
                hint=_HINT,
            )
        devices.append(
            NeuronDevice(
                index=int(entry.get("neuron_device", position)),
                nc_count=entry["nc_count"],
                memory_size=int(entry.get("memory_size") or 0),
                bdf=entry.get("bdf"),
            )
        )
    return tuple(devices)


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
    except subprocess.TimeoutExpired:
        raise DeviceError(
            f"{argv[0]} did not answer within {TOOL_TIMEOUT_S:.0f} s", hint=_HINT
        ) from None
    except OSError as err:
        raise DeviceError(f"cannot run {argv[0]}: {err}", hint=_HINT) from None


def _tool_failure(neuron_ls: str, proc: subprocess.CompletedProcess) -> DeviceError:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    fatal = next((parse_logfmt(line) for line in lines if "level=" in line), None)
    said = ": ".join(v for v in (fatal.get("msg"), fatal.get("error")) if v) if fatal else ""
    said = said or (lines[-1] if lines else "no output")
    return DeviceError(
        f"no Neuron devices: {neuron_ls} --json-output exited {proc.returncode} ({said})",
        hint="the Neuron driver is not loaded or this is not a Neuron instance; "
        "check `lsmod | grep neuron` and /dev/neuron*, or use --device cpu",
    )


def _family_from_sysfs(sysfs_root: Path) -> str | None:
    try:
        text = (sysfs_root / SYSFS_ARCHITECTURE / "instance_type").read_text().strip()
    except OSError:
        return None
    return text or None


def detect_neuron_host(
    env: Mapping[str, str], sysfs_root: Path = Path("/sys"), dev_root: Path = Path("/dev")
) -> NeuronHost:
    """The Neuron devices and chip family of this host; DeviceError saying what was looked for."""
    neuron_ls = find_neuron_ls(env.get("PATH"))
    if neuron_ls is None:
        dev_nodes = sorted(str(p) for p in dev_root.glob("neuron*"))
        seen = f"{len(dev_nodes)} /dev/neuron* node(s)" if dev_nodes else "no /dev/neuron* devices"
        raise DeviceError(
            f"no Neuron tools: neuron-ls is neither on PATH nor in {NEURON_TOOLS_DIR} ({seen})",
            hint=_HINT + "; if the tools are installed elsewhere, put that directory on PATH",
        )
    proc = _run_tool([neuron_ls, "--json-output"], env)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise _tool_failure(neuron_ls, proc)
    devices = parse_neuron_ls_json(proc.stdout)
    if not devices:
        raise DeviceError(f"no Neuron devices: {neuron_ls} --json-output listed none", hint=_HINT)
    instance_type, source = _family_from_sysfs(sysfs_root), "sysfs"
    if instance_type is None:
        proc = _run_tool([neuron_ls], env)
        match = _INSTANCE_TYPE_LINE.search(proc.stdout) if proc.returncode == 0 else None
        instance_type, source = match.group(1) if match else None, "neuron-ls"
    override = env.get(TARGET_OVERRIDE_ENV)
    if override:
        family, source = override, TARGET_OVERRIDE_ENV
    elif instance_type:
        family = instance_type.split(".")[0]
    else:
        raise DeviceError(
            f"cannot tell the Neuron chip family: no instance_type in {sysfs_root / SYSFS_ARCHITECTURE} "
            "and no `instance-type:` line from neuron-ls",
            hint=f"set {TARGET_OVERRIDE_ENV}=trn2 or trn3 (the vLLM plugin obeys it too)",
        )
    return NeuronHost(
        family=family,
        instance_type=instance_type,
        family_source=source,
        devices=devices,
        neuron_ls=neuron_ls,
    )


def require_family(host: NeuronHost, device: str) -> None:
    if host.family != device:
        where = f"{host.instance_type} " if host.instance_type else ""
        raise DeviceError(
            f"this host is {host.family} ({where}from {host.family_source}), not {device}",
            hint=f"pass --device {host.family}"
            if host.family in TARGETS and TARGETS[host.family].neuron
            else "serve-check supports trn2 and trn3 Neuron hosts, or --device cpu",
        )
