"""Writing a calibrated checkpoint: the original weights linked, the scales, index and config, atomically.

The input checkpoint is never written to. Everything goes to a temporary sibling of the
output, is checked, and is then renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.core.checkpoint import Checkpoint, SafetensorsHeader, write_json
from kvcalib.core.errors import CheckpointReadError, OutputExistsError
from kvcalib.core.schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    PROVENANCE_METADATA_KEY,
    SCALES_FILENAME,
    SINGLE_WEIGHTS_FILENAME,
    is_kv_scale_key,
)

__all__ = ["SHARDED_SINGLE_FILENAME", "WritePlan", "check_output_path", "copy_without_keys", "link_or_copy",
           "write_checkpoint"]

# transformers loads a top-level model.safetensors and ignores the index beside it, so it
# would never see the scales file: a single-file checkpoint's weights are linked under the
# sharded name instead (same bytes), and every loader then goes through the index.
SHARDED_SINGLE_FILENAME = "model-00001-of-00001.safetensors"


def check_output_path(output: Path, source: Path, overwrite: bool) -> None:
    """Refuse an output that exists (without overwrite) or that would touch the input."""
    out = Path(output).resolve()
    src = Path(source).resolve()
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        raise OutputExistsError(
            f"output {output} overlaps the input checkpoint {source}",
            hint="kvcalib never modifies its input; choose an output directory outside it",
        )
    if out.exists() and not overwrite:
        raise OutputExistsError(
            f"output {output} already exists",
            hint="choose a new path, or pass --overwrite to replace it",
        )
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output {output} exists and is not a directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputExistsError(f"output {output} cannot be created: {parent} is not a directory")
            break


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` to `dst` (same bytes, no extra space), copying across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_without_keys(header: SafetensorsHeader, dst: Path, drop: set[str]) -> None:
    """Write `header`'s file minus the tensors in `drop`; every kept tensor's bytes are copied verbatim."""
    src = header.path
    kept = [info for info in sorted(header.tensors.values(), key=lambda t: t.data_offsets) if info.key not in drop]
    new_header: dict[str, Any] = {}
    if header.metadata is not None:
        new_header["__metadata__"] = header.metadata
    offset = 0
    for info in kept:
        new_header[info.key] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    raw = json.dumps(new_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(struct.pack("<Q", len(raw)))
        fout.write(raw)
        for info in kept:
            fin.seek(header.data_start + info.data_offsets[0])
            remaining = info.nbytes
            while remaining:
                chunk = fin.read(min(remaining, 64 << 20))
                if not chunk:
                    raise CheckpointReadError(f"{src}: unexpected end of file")
                fout.write(chunk)
                remaining -= len(chunk)


@dataclass(frozen=True)
class WritePlan:
    """What `write_checkpoint` puts next to the original files."""

    scales: Mapping[str, Any]  # key -> float32 tensor [1]
    quantization_config: dict[str, Any]
    provenance: dict[str, Any]


@dataclass
class _Index:
    """The new index's weight_map and sizes, built up as files are written."""

    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0
    total_params: int = 0

    def add(self, key: str, file: str, nbytes: int, numel: int) -> None:
        self.weight_map[key] = file
        self.total_size += nbytes
        self.total_params += numel


def write_checkpoint(source: Checkpoint | Path, output: Path, plan: WritePlan, *, overwrite: bool = False,
                     check: Callable[[Path], None] | None = None) -> list[str]:
    """Write a new checkpoint: source files + scales + index + config, atomically.

    Weight files are hard-linked or copied byte for byte (a single `model.safetensors` under
    the sharded name `model-00001-of-00001.safetensors`, see SHARDED_SINGLE_FILENAME). A shard that already holds KV
    scales (from an earlier calibration) is rewritten without them, the kept tensors' bytes
    copied verbatim. Everything is written to a temporary sibling of `output`; `check` runs
    on it before it is renamed into place. Any failure or interrupt removes the temporary
    directory, and `source` is never written to. Returns notes for the user.
    """
    source = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    output = Path(output)
    check_output_path(output, source.root, overwrite)
    output.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.kvcalib-", dir=output.resolve().parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published checkpoint is not
        index = _Index()
        notes = _write_weights(source, tmp, index)
        _copy_other_files(source.root, tmp)
        _write_scales(tmp, plan, index)
        _write_index(tmp, source.files.index, index)
        config = dict(source.config)
        config.pop("compression_config", None)  # the 2024 name of quantization_config
        config["quantization_config"] = plan.quantization_config
        write_json(tmp / CONFIG_FILENAME, config)
        write_json(tmp / PROVENANCE_FILENAME, plan.provenance)
        if check is not None:
            check(tmp)
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return notes


def _write_weights(source: Checkpoint, tmp: Path, index: _Index) -> list[str]:
    """Link (or copy without earlier KV scales) every weight file into `tmp`; notes for the user."""
    notes = []
    for name in source.files.files:
        if name == SCALES_FILENAME:
            notes.append(f"replaced the existing {SCALES_FILENAME}")
            continue
        header = source.files.headers[name]
        stale = {k for k in header.tensors if is_kv_scale_key(k)}
        out_name = SHARDED_SINGLE_FILENAME if name == SINGLE_WEIGHTS_FILENAME else name
        if stale:
            copy_without_keys(header, tmp / out_name, stale)
            notes.append(f"{name}: dropped {len(stale)} earlier KV scale tensor(s)")
        else:
            link_or_copy(source.root / name, tmp / out_name)
        for key, info in header.tensors.items():
            if key not in stale:
                index.add(key, out_name, info.nbytes, math.prod(info.shape))
    return notes


def _write_scales(tmp: Path, plan: WritePlan, index: _Index) -> None:
    from safetensors.torch import save_file

    scales = {k: v.detach().to("cpu").contiguous() for k, v in plan.scales.items()}
    clash = sorted(set(scales) & set(index.weight_map))
    if clash:
        raise CheckpointReadError(f"scale key {clash[0]} already exists in {index.weight_map[clash[0]]}")
    save_file(scales, str(tmp / SCALES_FILENAME),
              metadata={"format": "pt", PROVENANCE_METADATA_KEY: json.dumps(plan.provenance, sort_keys=True)})
    os.chmod(tmp / SCALES_FILENAME, 0o644)
    for key, tensor in scales.items():
        index.add(key, SCALES_FILENAME, tensor.numel() * tensor.element_size(), tensor.numel())


def _write_index(tmp: Path, source_index: dict[str, Any] | None, index: _Index) -> None:
    out: dict[str, Any] = dict(source_index) if source_index is not None else {}
    metadata = dict(out.get("metadata") or {})
    metadata["total_size"] = index.total_size
    if "total_parameters" in metadata:  # newer transformers record it; keep it true
        metadata["total_parameters"] = index.total_params
    out["metadata"] = metadata
    out["weight_map"] = dict(sorted(index.weight_map.items()))
    write_json(tmp / INDEX_FILENAME, out)


def _copy_other_files(source: Path, dest: Path) -> None:
    """Tokenizer, generation config, remote code, ...: everything but what we rewrite."""
    rewritten = {CONFIG_FILENAME, INDEX_FILENAME, PROVENANCE_FILENAME}
    for entry in sorted(source.iterdir()):
        if entry.name.startswith(".") or entry.name in rewritten or entry.name.endswith(".safetensors"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, copy_function=link_or_copy)
        elif entry.is_file():
            shutil.copy2(entry, dest / entry.name)


def _publish(tmp: Path, output: Path) -> None:
    """Rename the finished temporary directory into place, replacing an old output."""
    if output.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.resolve().parent))
        os.replace(output, trash / "old")
        os.replace(tmp, output)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, output)

