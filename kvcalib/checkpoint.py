"""Checkpoint files: read config, index and safetensors headers; write a new checkpoint atomically.

Reading never loads a tensor unless asked for it by key (`load_tensors`), so a checkpoint of
any size is inspected in about the time it takes to read a few headers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointNotFoundError, CheckpointReadError, OutputExistsError
from .schema import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    PROVENANCE_FILENAME,
    SCALES_FILENAME,
    SINGLE_WEIGHTS_FILENAME,
    is_kv_scale_key,
)

# transformers loads a top-level model.safetensors and ignores the index beside it, so it
# would never see the scales file: a single-file checkpoint's weights are linked under the
# sharded name instead (same bytes), and every loader then goes through the index.
SHARDED_SINGLE_FILENAME = "model-00001-of-00001.safetensors"

# safetensors refuses headers above 100 MB; so do we, before reading them.
MAX_HEADER_BYTES = 100_000_000

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensors by key, the metadata, where the data starts."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file; a clear CheckpointReadError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} not found: {path}") from None
    except (OSError, ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, UnicodeDecodeError and an over-long integer literal;
        # RecursionError: arrays/objects nested too deep for the json module.
        raise CheckpointReadError(
            f"cannot parse {what} {path}: {exc}",
            hint="the file is not valid JSON; restore it from the original checkpoint",
        ) from None


def write_json(path: Path, obj: Any) -> None:
    """JSON with indent=2 and sorted keys, so diffs between checkpoints stay small."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_config(ckpt_dir: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, as a dict."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint directory not found: {ckpt_dir}",
            hint="pass a local Hugging Face checkpoint directory (config.json + *.safetensors)",
        )
    config = read_json(ckpt_dir / CONFIG_FILENAME, "config.json")
    if not isinstance(config, dict):
        raise CheckpointReadError(f"{ckpt_dir / CONFIG_FILENAME} is not a JSON object")
    return config


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse the header of a safetensors file without reading any tensor data."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointReadError(
                    f"{path}: truncated safetensors file ({file_size} bytes, no header length)",
                    hint="the file was cut short; copy it again from the source",
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointReadError(
                    f"{path}: safetensors header of {header_len} bytes is over the {MAX_HEADER_BYTES} byte limit",
                    hint="the file is corrupt or not a safetensors file",
                )
            if 8 + header_len > file_size:
                raise CheckpointReadError(
                    f"{path}: truncated safetensors file (header says {header_len} bytes, file has {file_size})",
                    hint="the file was cut short; copy it again from the source",
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointReadError(f"cannot read {path}: {exc}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # see read_json
        raise CheckpointReadError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointReadError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + header_len
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointReadError(f"{path}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        tensors[key] = _tensor_info(path, key, entry, data_size)
    return SafetensorsHeader(path, tensors, metadata, data_start, file_size)


def _tensor_info(path: Path, key: str, entry: Any, data_size: int) -> TensorInfo:
    bad = CheckpointReadError(f"{path}: malformed header entry for tensor {key!r}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        not isinstance(dtype, str)
        or dtype not in DTYPE_SIZES
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
    ):
        raise bad
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end <= data_size or end - begin != numel * DTYPE_SIZES[dtype]:
        raise CheckpointReadError(
            f"{path}: tensor {key!r} points outside the file or has the wrong byte size",
            hint="the file is truncated or corrupt; copy it again from the source",
        )
    return TensorInfo(key, dtype, tuple(shape), (begin, end))


@dataclass(frozen=True)
class CheckpointFiles:
    """The safetensors side of a checkpoint directory: files, headers, and the index if any."""

    root: Path
    files: tuple[str, ...]  # top-level *.safetensors, sorted
    headers: dict[str, SafetensorsHeader]
    index: dict[str, Any] | None
    key_files: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> files holding it

    def file_of(self, key: str) -> str | None:
        """The file a loader reads `key` from: the index's entry if there is an index."""
        if self.index is not None:
            wm = self.index.get("weight_map")
            return wm.get(key) if isinstance(wm, dict) else None
        files = self.key_files.get(key)
        return files[0] if files else None


def scan_checkpoint(ckpt_dir: Path) -> CheckpointFiles:
    """Read every top-level safetensors header and the index (no tensor data)."""
    ckpt_dir = Path(ckpt_dir)
    files = tuple(sorted(p.name for p in ckpt_dir.glob("*.safetensors") if p.is_file()))
    headers = {name: read_safetensors_header(ckpt_dir / name) for name in files}
    index_path = ckpt_dir / INDEX_FILENAME
    index = read_json(index_path, "safetensors index") if index_path.exists() else None
    if index is not None and not isinstance(index, dict):
        raise CheckpointReadError(f"{index_path} is not a JSON object")
    key_files: dict[str, list[str]] = {}
    for name in files:
        for key in headers[name].tensors:
            key_files.setdefault(key, []).append(name)
    return CheckpointFiles(
        ckpt_dir, files, headers, index, {k: tuple(v) for k, v in key_files.items()}
    )


def read_tensor(header: SafetensorsHeader, key: str) -> Any:
    """One tensor of a parsed file, read at its offsets (a torch tensor; nothing else is read).

    Unlike `load_tensors`, this needs only what `read_safetensors_header` checked, so it
    also reads files that safetensors itself would refuse for unrelated reasons.
    """
    import torch

    info = header.tensors[key]
    dtype = getattr(torch, _TORCH_DTYPES[info.dtype], None)
    if dtype is None:
        raise CheckpointReadError(f"{header.path}: tensor {key!r} has dtype {info.dtype}, which this torch cannot read")
    try:
        with open(header.path, "rb") as f:
            f.seek(header.data_start + info.data_offsets[0])
            raw = f.read(info.nbytes)
    except OSError as exc:
        raise CheckpointReadError(f"cannot read {header.path}: {exc}") from None
    if len(raw) != info.nbytes:
        raise CheckpointReadError(f"{header.path}: unexpected end of file reading tensor {key!r}")
    if not raw:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(info.shape)


_TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}


def load_tensors(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    """Load just `keys` from one safetensors file (as torch tensors)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in keys}


# --- writing ------------------------------------------------------------------------------


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


def copy_without_keys(src: Path, dst: Path, drop: set[str]) -> None:
    """Write `src` minus the tensors in `drop`; every kept tensor's bytes are copied verbatim."""
    header = read_safetensors_header(src)
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


def write_checkpoint(
    source: Path,
    output: Path,
    plan: WritePlan,
    *,
    overwrite: bool = False,
    check: Callable[[Path], None] | None = None,
) -> list[str]:
    """Write a new checkpoint: source files + scales + index + config, atomically.

    Weight files are hard-linked or copied byte for byte (a single `model.safetensors` under
    the sharded name `model-00001-of-00001.safetensors`, see SHARDED_SINGLE_FILENAME). A shard that already holds KV
    scales (from an earlier calibration) is rewritten without them, the kept tensors' bytes
    copied verbatim. Everything is written to a temporary sibling of `output`; `check` runs
    on it before it is renamed into place. Any failure or interrupt removes the temporary
    directory, and `source` is never written to. Returns notes for the user.
    """
    from safetensors.torch import save_file

    source, output = Path(source), Path(output)
    check_output_path(output, source, overwrite)
    files = scan_checkpoint(source)
    notes: list[str] = []
    output.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.kvcalib-", dir=output.resolve().parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published checkpoint is not
        weight_map: dict[str, str] = {}
        total_size = total_params = 0
        for name in files.files:
            if name == SCALES_FILENAME:
                notes.append(f"replaced the existing {SCALES_FILENAME}")
                continue
            header = files.headers[name]
            stale = {k for k in header.tensors if is_kv_scale_key(k)}
            out_name = SHARDED_SINGLE_FILENAME if name == SINGLE_WEIGHTS_FILENAME else name
            if stale:
                copy_without_keys(source / name, tmp / out_name, stale)
                notes.append(f"{name}: dropped {len(stale)} earlier KV scale tensor(s)")
            else:
                link_or_copy(source / name, tmp / out_name)
            for key, info in header.tensors.items():
                if key not in stale:
                    weight_map[key] = out_name
                    total_size += info.nbytes
                    total_params += math.prod(info.shape)
        _copy_other_files(source, tmp)

        scales = {k: v.detach().to("cpu").contiguous() for k, v in plan.scales.items()}
        clash = sorted(set(scales) & set(weight_map))
        if clash:
            raise CheckpointReadError(f"scale key {clash[0]} already exists in {weight_map[clash[0]]}")
        save_file(
            scales,
            str(tmp / SCALES_FILENAME),
            metadata={"format": "pt", "kvcalib": json.dumps(plan.provenance, sort_keys=True)},
        )
        os.chmod(tmp / SCALES_FILENAME, 0o644)
        for key, tensor in scales.items():
            weight_map[key] = SCALES_FILENAME
            total_size += tensor.numel() * tensor.element_size()
            total_params += tensor.numel()

        index: dict[str, Any] = dict(files.index) if files.index is not None else {}
        metadata = dict(index.get("metadata") or {})
        metadata["total_size"] = total_size
        if "total_parameters" in metadata:  # newer transformers record it; keep it true
            metadata["total_parameters"] = total_params
        index["metadata"] = metadata
        index["weight_map"] = dict(sorted(weight_map.items()))
        write_json(tmp / INDEX_FILENAME, index)

        config = read_config(source)
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


def read_kv_scales(ckpt_dir: Path, num_layers: int, layers_prefix: str = "model.layers") -> tuple[list[float], list[float]]:
    """Per-layer (k_scales, v_scales) as the Neuron loader reads them; an error names a missing key."""
    from .schema import neuron_scale_key

    files = scan_checkpoint(ckpt_dir)
    values: dict[str, list[float]] = {"k": [], "v": []}
    for kind in ("k", "v"):
        for layer in range(num_layers):
            key = neuron_scale_key(layer, kind, layers_prefix)
            name = files.file_of(key)
            if name is None or name not in files.headers or key not in files.headers[name].tensors:
                raise CheckpointReadError(
                    f"{ckpt_dir}: no KV scale {key}",
                    hint=f"run `kvcalib validate {ckpt_dir}`; calibrate it with `kvcalib calibrate`",
                )
            tensor = load_tensors(ckpt_dir / name, [key])[key]
            if tensor.numel() != 1:
                raise CheckpointReadError(f"{ckpt_dir}: {key} has shape {list(tensor.shape)}, not [1]",
                                          hint="kvcalib evaluates per-tensor scales only")
            values[kind].append(float(tensor.float().reshape(())))
    return values["k"], values["v"]
