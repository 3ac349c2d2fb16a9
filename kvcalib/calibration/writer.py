"""Writing a calibrated checkpoint: the original weights linked, the scales, index and config, atomically.

The input is never written to; everything goes to a staging sibling of OUT and is published (publish.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.calibration.publish import discard, publish, recover, stage
from kvcalib.core.checkpoint import Checkpoint, load_tensors, write_json
from kvcalib.core.errors import OutputExistsError, OutputWriteError
from kvcalib.core.paths import overlapping
from kvcalib.core.schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    PROVENANCE_METADATA_KEY,
    SCALES_FILENAME,
    SINGLE_WEIGHTS_FILENAME,
    is_kv_scale_key,
)

__all__ = [
    "LINK_AT_BYTES",
    "Room",
    "WritePlan",
    "bytes_needed",
    "check_output_path",
    "check_room",
    "measure_room",
    "write_checkpoint",
]

# transformers loads a top-level model.safetensors and ignores the index beside it (and so the scales file): a
# single-file checkpoint's weights are linked under the sharded name instead, so every loader reads the index.
SHARDED_SINGLE_FILENAME = "model-00001-of-00001.safetensors"


def check_output_path(
    output: Path,
    inputs: Sequence[tuple[str, Path]],
    overwrite: bool,
    *,
    recover_leftovers: bool = True,
) -> list[str]:
    """Refuse an output overlapping an input, a link, or existing (no overwrite); recover leftovers, return notes."""
    output = Path(output)
    for what, path in inputs:
        if os.path.lexists(path) and overlapping(output, path):
            raise OutputExistsError(
                f"output {output} overlaps {what} {path} (after symlinks: {output.resolve()} and "
                f"{Path(path).resolve()})",
                hint=f"kvcalib never writes over its inputs; choose an output directory outside {path}",
            )
    if output.is_symlink():
        raise OutputExistsError(
            f"output {output} is a symbolic link (to {os.readlink(output)})",
            hint="pass a real directory path: the new checkpoint is renamed into place, which "
            "would replace the link itself",
        )
    ancestor = _existing_ancestor(output.parent)
    if (os.path.lexists(output) and not output.is_dir()) or not ancestor.is_dir():
        raise OutputExistsError(
            f"output {output} exists and is not a directory"
            if os.path.lexists(output)
            else f"output {output} cannot be created: {ancestor} is not a directory",
            hint="choose an output path that is a directory or can be made one (--overwrite replaces only a "
            "directory)",
        )
    notes = recover(output) if recover_leftovers else []
    if output.exists() and not overwrite:
        raise OutputExistsError(
            f"output {output} already exists" + "".join(f"; {note}" for note in notes),
            hint="choose a new path, or pass --overwrite to replace it",
        )
    if output.exists() and any(output.iterdir()) and not (output / CONFIG_FILENAME).is_file():
        raise OutputExistsError(
            f"output {output} exists and is not a checkpoint (no {CONFIG_FILENAME}): --overwrite replaces only "
            "an earlier checkpoint or an empty directory",
            hint="choose a new path for the checkpoint; nothing in that directory was touched",
        )
    return notes


@dataclass(frozen=True)
class Room:
    """What writing OUT takes on its filesystem: the new bytes, whether the weights are hard links, the free space."""

    needed: int
    free: int
    linkable: bool
    where: Path  # OUT's nearest existing ancestor


def measure_room(output: Path, source: Checkpoint) -> Room:
    """Probe OUT's nearest existing ancestor (a file written and removed, a hard link tried) and add up the need."""
    output = Path(output)
    ancestor = _existing_ancestor(output)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{output.name}.kvcalib-probe-", dir=ancestor)
    except OSError as exc:
        raise _write_error(exc, output, ancestor) from None
    os.close(fd)
    names, linkable = source.files.files, True
    try:
        if names:  # a hard link where the probe was
            os.unlink(probe)
            os.link(source.root / names[0], probe)
    except OSError:
        linkable = False
    finally:
        Path(probe).unlink(missing_ok=True)
    return Room(
        bytes_needed(source, linkable), shutil.disk_usage(ancestor).free, linkable, ancestor
    )


def check_room(output: Path, source: Checkpoint) -> None:
    """Before any work: can OUT's parent (or its nearest existing ancestor) take the new files? (measure_room)"""
    room = measure_room(output, source)
    if room.needed > room.free:
        copied = "" if room.linkable else " (the weights are copied: hard links do not work there)"
        raise OutputWriteError(
            f"not enough space for {output}: the new files need {room.needed / 1e6:,.1f} MB, {room.where} has "
            f"{room.free / 1e6:,.1f} MB free" + copied,
            hint="free some space, or choose an output on a filesystem with room (on the model's own filesystem "
            "the weights are hard links and take no space)",
        )


def bytes_needed(source: Checkpoint, linkable: bool) -> int:
    """What write_checkpoint adds on disk: copied weights (all of them if links fail), other files, the new JSON."""
    total = (
        64 << 10
    )  # scales, config, provenance: a few KB; the margin covers the filesystem's blocks
    for header in source.files.headers.values():
        if not linkable or any(is_kv_scale_key(k) for k in header.tensors):
            total += header.file_size
    index = source.root / INDEX_FILENAME
    total += 2 * index.stat().st_size if index.is_file() else 0
    for entry in _other_files(source.root):
        for path in entry.rglob("*") if entry.is_dir() else [entry]:
            if path.is_file():
                size = path.stat().st_size
                total += size if size < LINK_AT_BYTES or not linkable else 0
    return total


def _existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


_ERRNO_HINTS = {
    errno.ENOSPC: "the filesystem is full: free some space, or choose an output elsewhere",
    errno.EDQUOT: "your disk quota is used up: free some space, or choose an output elsewhere",
    errno.EROFS: "the filesystem is read-only: choose an output on a writable one",
    errno.EACCES: "you may not write there: choose a directory you own, or fix its permissions",
    errno.EPERM: "the directory refuses writes (immutable or a restricted mount): choose another output",
}


def _write_error(exc: OSError, output: Path, where: Path | None = None) -> OutputWriteError:
    where = exc.filename or where or output
    return OutputWriteError(
        f"cannot write {output}: {exc.strerror or exc} ({where}); nothing at {output} was changed",
        hint=_ERRNO_HINTS.get(
            exc.errno or 0, "check the output directory: permissions, space, the filesystem"
        ),
    )


@dataclass(frozen=True)
class WritePlan:
    """What `write_checkpoint` puts next to the original files."""

    scales: Mapping[str, Any]  # key -> float32 CPU tensor [1] (per head: [heads, 1, 1])
    quantization_config: dict[str, Any]
    provenance: dict[str, Any]


def write_checkpoint(
    source: Checkpoint | Path,
    output: Path,
    plan: WritePlan,
    *,
    overwrite: bool = False,
    check: Callable[[Path], None] | None = None,
    inputs: Sequence[tuple[str, Path]] = (),
) -> list[str]:
    """Write source files (earlier KV scales dropped), scales, index, config in a staging sibling; `check`; publish."""
    source = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    output = Path(os.path.abspath(output))
    notes = check_output_path(output, [("the model checkpoint", source.root), *inputs], overwrite)
    parents = list(output.parents)  # OUT's missing parents, deepest first: removed again on failure
    created, staging = parents[: parents.index(_existing_ancestor(output.parent))], None
    for path in reversed(created):
        path.mkdir()
    try:
        staging = stage(output)
        notes += _write_files(source, staging.checkpoint, plan)
        if check is not None:
            check(staging.checkpoint)
        publish(staging)
    except BaseException as exc:
        if staging is not None:
            discard(staging)
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()
        if isinstance(exc, OSError):
            raise _write_error(exc, output) from None
        raise
    return notes


def _write_files(source: Checkpoint, dest: Path, plan: WritePlan) -> list[str]:
    """Link (or copy without earlier KV scales) every weight file into `dest`, carry the other files over, write
    the scales, the index, config and provenance; notes for the user."""
    from safetensors.torch import save_file

    index: dict[str, tuple[str, int, int]] = {}  # the new index: key -> (file, bytes, numel)
    notes = []
    for name in source.files.files:
        if name == SCALES_FILENAME:
            notes.append(f"replaced the existing {SCALES_FILENAME}")
            continue
        header = source.files.headers[name]
        stale = {k for k in header.tensors if is_kv_scale_key(k)}
        out_name = SHARDED_SINGLE_FILENAME if name == SINGLE_WEIGHTS_FILENAME else name
        if stale:  # the other tensors' bytes as they are
            kept = load_tensors(header.path, [k for k in header.tensors if k not in stale])
            save_file(kept, str(dest / out_name), metadata=header.metadata)
            notes.append(f"{name}: dropped {len(stale)} earlier KV scale tensor(s)")
        else:
            _carry(source.root / name, dest / out_name, link=True)
        index.update(
            (key, (out_name, info.nbytes, math.prod(info.shape)))
            for key, info in header.tensors.items()
            if key not in stale
        )
    for entry in _other_files(source.root):
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, copy_function=_carry)
        elif entry.is_file():
            _carry(entry, dest / entry.name)
    # (a scale key the weights also hold is in two files: validate refuses it before publishing)
    scales = dict(plan.scales)  # CPU tensors (scales.scale_tensors)
    metadata = {
        "format": "pt",
        PROVENANCE_METADATA_KEY: json.dumps(plan.provenance, sort_keys=True),
    }
    save_file(scales, str(dest / SCALES_FILENAME), metadata=metadata)
    os.chmod(dest / SCALES_FILENAME, 0o644)
    index.update(
        (k, (SCALES_FILENAME, t.numel() * t.element_size(), t.numel())) for k, t in scales.items()
    )
    out: dict[str, Any] = dict(source.files.index or {})
    metadata = dict(out.get("metadata") or {})
    metadata["total_size"] = sum(nbytes for _, nbytes, _ in index.values())
    if "total_parameters" in metadata:  # newer transformers record it; keep it true
        metadata["total_parameters"] = sum(numel for _, _, numel in index.values())
    out["metadata"] = metadata
    out["weight_map"] = {key: file for key, (file, _, _) in sorted(index.items())}
    write_json(dest / INDEX_FILENAME, out)
    config = dict(source.config)
    config.pop("compression_config", None)  # the 2024 name of quantization_config
    config["quantization_config"] = plan.quantization_config
    write_json(dest / CONFIG_FILENAME, config)
    write_json(dest / PROVENANCE_FILENAME, plan.provenance)
    return notes


# Files at least this large (pytorch_model.bin, original/consolidated.pth) are hard-linked like the weights; smaller
# ones (tokenizer, generation config) are copied, so that editing them in the output cannot change the input.
LINK_AT_BYTES = 16 << 20


def _other_files(source: Path) -> list[Path]:
    """Tokenizer, generation config, remote code, ...: everything the writer carries over unchanged."""
    rewritten = {CONFIG_FILENAME, INDEX_FILENAME, PROVENANCE_FILENAME}
    return [
        entry
        for entry in sorted(source.iterdir())
        if not (
            entry.name.startswith(".")
            or entry.name in rewritten
            or entry.name.endswith(".safetensors")
        )
    ]


def _carry(src: str | Path, dst: str | Path, link: bool = False) -> None:
    """Hard-link weights and files of LINK_AT_BYTES or more (a copy where links fail); copy the rest."""
    try:
        if link or os.path.getsize(src) >= LINK_AT_BYTES:
            return os.link(src, dst)
    except OSError:
        pass
    shutil.copy2(src, dst)
