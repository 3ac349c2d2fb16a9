"""Checkpoint files, read side: config, index, safetensors headers, tensors by key (never a tensor unless asked)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.core.errors import CheckpointNotFoundError, CheckpointReadError, KvcalibError
from kvcalib.core.paths import require_regular_file
from kvcalib.core.schema import CONFIG_FILENAME, INDEX_FILENAME

__all__ = [
    "Checkpoint",
    "CheckpointFiles",
    "SafetensorsHeader",
    "TensorInfo",
    "load_tensors",
    "read_config",
    "read_json",
    "read_safetensors_header",
    "read_scale_values",
    "read_values",
    "scan_checkpoint",
    "write_json",
]

# The one table of safetensors dtypes: name -> the torch dtype's name, numpy's too but for BF16 (read as the top half
# of a float32) and FP8 (read through torch).
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what from_pretrained casts to the model's dtype
_CORRUPT = "the file is corrupt, cut short or not a safetensors file; copy it again from the source"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

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
    require_regular_file(path, what, hint=f"restore {Path(path).name} from the original checkpoint")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:  # permission denied, an I/O error: not a parse problem
        raise CheckpointReadError(
            f"cannot read {what} {path}: {exc.strerror or exc}", hint="check the file's permissions"
        ) from None
    # bad JSON or UTF-8, an integer over Python's digit limit, nesting too deep
    except (ValueError, RecursionError) as exc:
        raise CheckpointReadError(
            f"cannot parse {what} {path}: {exc}",
            hint="the file is not JSON Python can read; restore it from the original checkpoint",
        ) from None


def write_json(path: Path, obj: Any) -> None:
    """JSON with indent=2 and sorted keys, so diffs between checkpoints stay small."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_config(ckpt_dir: Path) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint directory not found: {ckpt_dir}",
            hint="pass a local Hugging Face checkpoint directory (config.json + *.safetensors)",
        )
    config = read_json(ckpt_dir / CONFIG_FILENAME, "config.json")
    if not isinstance(config, dict):
        raise CheckpointReadError(
            f"{ckpt_dir / CONFIG_FILENAME} is not a JSON object",
            hint="config.json holds one object; restore it from the original checkpoint",
        )
    return config


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse the header of a safetensors file without reading any tensor data, once safetensors itself has checked it
    (every entry well-formed, the tensors tiling the data in order, no gap, no overlap) and kvcalib knows its dtypes."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(path, framework="numpy"):  # safetensors' own checks; no tensor is read
            pass
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        file_size = path.stat().st_size
    except OSError as exc:
        raise CheckpointReadError(
            f"cannot read {path}: {exc.strerror or exc}", hint="check the file's permissions"
        ) from None
    except SafetensorError as exc:
        raise CheckpointReadError(
            f"{path}: {exc}; safetensors refuses the file", hint=_CORRUPT
        ) from None
    metadata = header.pop("__metadata__", None)
    tensors = {
        key: TensorInfo(entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"]))
        for key, entry in header.items()
    }
    unknown = sorted(key for key, info in tensors.items() if info.dtype not in _DTYPES)
    if unknown:
        raise CheckpointReadError(
            f"{path}: tensor {unknown[0]!r} has dtype {tensors[unknown[0]].dtype}, which kvcalib cannot read",
            hint="kvcalib reads the safetensors dtypes torch loads: " + ", ".join(_DTYPES),
        )
    return SafetensorsHeader(path, tensors, metadata, 8 + header_len, file_size)


@dataclass(frozen=True)
class CheckpointFiles:
    """The safetensors side of a checkpoint directory: files, headers, the index if any."""

    root: Path
    files: tuple[str, ...]  # top-level *.safetensors, sorted
    headers: dict[
        str, SafetensorsHeader
    ]  # the files whose header parsed (all of them unless tolerant)
    index: dict[str, Any] | None  # None: no index (or, tolerant, an unusable one)
    key_files: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> files holding it
    problems: tuple[
        tuple[str, KvcalibError], ...
    ] = ()  # tolerant scans: (file name, what was wrong)

    @property
    def weight_map(self) -> dict[str, Any] | None:
        return self.index.get("weight_map") if self.index is not None else None

    @property
    def unreadable(self) -> tuple[str, ...]:
        return tuple(name for name in self.files if name not in self.headers)

    def file_of(self, key: str) -> str | None:
        """The file a loader reads `key` from: the index's when it holds it, else the first that does."""
        holders = self.key_files.get(key, ())
        mapped = self.weight_map.get(key) if self.weight_map is not None else None
        return mapped if mapped in holders else holders[0] if holders else None

    def header_of(self, key: str) -> SafetensorsHeader | None:
        name = self.file_of(key)
        return self.headers[name] if name is not None else None


def scan_checkpoint(ckpt_dir: Path, *, tolerant: bool = False) -> CheckpointFiles:
    """Every top-level header and the index; one unusable raises, or with `tolerant` is listed in `problems`."""
    ckpt_dir = Path(ckpt_dir)
    files = tuple(sorted(p.name for p in ckpt_dir.glob("*.safetensors") if p.is_file()))
    headers = {}
    index, problems, key_files = None, [], {}
    for name in (*files, INDEX_FILENAME):
        try:
            if name != INDEX_FILENAME:
                headers[name] = read_safetensors_header(ckpt_dir / name)
            elif (ckpt_dir / name).exists():  # an object whose weight_map is an object
                found = read_json(ckpt_dir / name, "safetensors index")
                if not isinstance(found, dict) or not isinstance(found.get("weight_map"), dict):
                    what = "its weight_map" if isinstance(found, dict) else "the index"
                    raise CheckpointReadError(
                        f"{name}: {what} is not a JSON object: an index-based loader cannot use it",
                        hint="restore the index from the original checkpoint, or delete it if all "
                        "weights are in one file",
                    )
                index = found
        except KvcalibError as exc:
            if not tolerant:
                raise
            problems.append((name, exc))
    for name, header in headers.items():
        for key in header.tensors:
            key_files[key] = (*key_files.get(key, ()), name)
    return CheckpointFiles(ckpt_dir, files, headers, index, key_files, tuple(problems))


def read_values(header: SafetensorsHeader, key: str, count: int | None = None) -> list[float]:
    """The first `count` elements (None: all) of one tensor as floats, read with numpy (torch only for FP8)."""
    info = header.tensors[key]
    size = _size(info.dtype)
    count = info.nbytes // size if count is None else count
    try:
        with open(header.path, "rb") as f:
            f.seek(header.data_start + info.data_offsets[0])
            raw = f.read(size * count)
    except OSError as exc:
        raise CheckpointReadError(
            f"cannot read {header.path}: {exc.strerror or exc}", hint="check the file's permissions"
        ) from None
    if count < 1 or len(raw) != size * count or info.nbytes < size * count:
        raise CheckpointReadError(
            f"{header.path}: unexpected end of file reading tensor {key!r}", hint=_CORRUPT
        )
    if info.dtype == "BF16":  # the top half of a float32
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").tolist()
    if info.dtype.startswith("F8"):  # only torch decodes it
        import torch

        return (
            torch.frombuffer(bytearray(raw), dtype=getattr(torch, _DTYPES[info.dtype]))
            .double()
            .tolist()
        )
    return (
        np.frombuffer(raw, np.dtype(_DTYPES[info.dtype]).newbyteorder("<")).astype(float).tolist()
    )


def _size(dtype: str) -> int:
    """Bytes per element of safetensors dtype `dtype`."""
    return 2 if dtype == "BF16" else 1 if dtype[:2] == "F8" else np.dtype(_DTYPES[dtype]).itemsize


def load_tensors(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in keys}


def read_scale_values(
    ckpt_dir: Path, files: CheckpointFiles, key: str, required: bool = True
) -> list[float] | None:
    """Every value of scale `key` where a loader finds it (None if absent and not `required`; else an error)."""
    header = files.header_of(key)
    if header is None and not required:
        return None
    values = read_values(header, key) if header is not None else []
    if not values:
        raise CheckpointReadError(
            f"{ckpt_dir}: no KV scale {key}" if header is None else f"{ckpt_dir}: {key} is empty",
            hint=f"run `kvcalib validate {ckpt_dir}`; calibrate it with `kvcalib calibrate`",
        )
    return values


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, each of its files read once: config.json now, the rest on first use."""

    root: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, root: Path) -> Checkpoint:
        return cls(Path(root), read_config(root))

    @cached_property
    def files(self) -> CheckpointFiles:
        return scan_checkpoint(self.root)

    def _float_tensors(self) -> list[TensorInfo]:
        headers = (self.files.headers[name] for name in self.files.files)
        return [info for h in headers for info in h.tensors.values() if info.dtype in _FLOAT_DTYPES]

    def stored_dtype(self) -> str | None:
        """What `from_pretrained(dtype="auto")` picks: config's dtype, else the first floating tensor's."""
        name = self.config.get("dtype") or self.config.get("torch_dtype")
        if name in _DTYPES.values():
            return name
        return next((_DTYPES[info.dtype] for info in self._float_tensors()), None)

    def stored_float_dtypes(self) -> list[str]:
        return sorted({_DTYPES[info.dtype] for info in self._float_tensors()})

    def weight_bytes(self, element_size: int | None) -> int:
        """Bytes the tensors take with floating ones at `element_size` (None: as stored)."""
        return sum(
            info.nbytes // _size(info.dtype) * element_size
            if element_size is not None and info.dtype in _FLOAT_DTYPES
            else info.nbytes
            for header in self.files.headers.values()
            for info in header.tensors.values()
        )
