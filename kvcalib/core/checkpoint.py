"""Checkpoint files, read side: config, index, safetensors headers, tensors by key (never a tensor unless asked)."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kvcalib.core.errors import CheckpointNotFoundError, CheckpointReadError, KvcalibError
from kvcalib.core.paths import require_regular_file
from kvcalib.core.schema import CONFIG_FILENAME, INDEX_FILENAME

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_HEADER_BYTES",
    "Checkpoint",
    "CheckpointFiles",
    "SafetensorsHeader",
    "TensorInfo",
    "load_tensors",
    "read_config",
    "read_json",
    "read_safetensors_header",
    "read_scale_values",
    "read_tensor",
    "read_values",
    "scan_checkpoint",
    "torch_dtype_name",
    "write_json",
]

# safetensors refuses headers above 100 MB; so do we, before reading them.
MAX_HEADER_BYTES = 100_000_000

# The one table of safetensors dtypes: name -> (bytes per element, torch dtype name).
_DTYPES = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
}
DTYPE_SIZES = {name: size for name, (size, _torch) in _DTYPES.items()}
FLOAT_DTYPES = frozenset(
    {"F16", "BF16", "F32", "F64"}
)  # what from_pretrained casts to the model's dtype


def torch_dtype_name(dtype: str) -> str:
    """The torch name ("bfloat16") of a safetensors dtype ("BF16")."""
    return _DTYPES[dtype][1]


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
    require_regular_file(path, what, hint=f"restore {Path(path).name} from the original checkpoint")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} not found: {path}", hint="check the path") from None
    except OSError as exc:  # permission denied, an I/O error: not a parse problem
        raise CheckpointReadError(
            f"cannot read {what} {path}: {exc.strerror or exc}", hint="check the file's permissions"
        ) from None
    except (ValueError, RecursionError) as exc:
        # ValueError: bad JSON, bad UTF-8, an over-long integer literal; RecursionError: nested too deep
        if not isinstance(
            exc, (json.JSONDecodeError, UnicodeDecodeError)
        ) and "integer string" in str(exc):
            raise CheckpointReadError(
                f"{what} {path} holds an integer of more than {sys.get_int_max_str_digits()} digits, which "
                "Python refuses to read (its integer-size limit, sys.get_int_max_str_digits): the JSON is valid, "
                "but no setting of a checkpoint is that long",
                hint=f"restore {Path(path).name} from the original checkpoint, or shorten that number",
            ) from None
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
    """Parse the header of a safetensors file without reading any tensor data."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointReadError(
                    f"{path}: truncated safetensors file ({file_size} bytes, no header length)",
                    hint=_CUT,
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointReadError(
                    f"{path}: safetensors header of {header_len} bytes is over the "
                    f"{MAX_HEADER_BYTES} byte limit",
                    hint="the file is corrupt or not a safetensors file",
                )
            if 8 + header_len > file_size:
                raise CheckpointReadError(
                    f"{path}: truncated safetensors file (header says {header_len} bytes, "
                    f"file has {file_size})",
                    hint=_CUT,
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointReadError(
            f"cannot read {path}: {exc.strerror or exc}", hint=_PERMISSIONS
        ) from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # see read_json
        raise CheckpointReadError(
            f"{path}: safetensors header is not valid JSON ({exc})", hint=_CORRUPT
        ) from None
    if not isinstance(header, dict):
        raise CheckpointReadError(f"{path}: safetensors header is not a JSON object", hint=_CORRUPT)
    data_start = 8 + header_len
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointReadError(
            f"{path}: __metadata__ must map strings to strings", hint=_CORRUPT
        )
    tensors = {key: _tensor_info(path, key, entry, data_size) for key, entry in header.items()}
    _check_layout(path, tensors, data_size)
    return SafetensorsHeader(path, tensors, metadata, data_start, file_size)


_CORRUPT = "the file is corrupt or not a safetensors file; copy it again from the source"
_CUT = "the file was cut short; copy it again from the source"
_PERMISSIONS = "check the file's permissions, or copy it again from the source"


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The format's rule (and safetensors' own check): the tensors tile the data, in order, no gap, no overlap."""
    end, previous = 0, None
    for info in sorted(tensors.values(), key=lambda t: t.data_offsets):
        begin = info.data_offsets[0]
        if begin != end:
            what = (
                f"overlaps tensor {previous!r}"
                if begin < end
                else f"leaves {begin - end} bytes no tensor covers before it"
            )
            raise CheckpointReadError(
                f"{path}: tensor {info.key!r} at bytes {list(info.data_offsets)} {what}; "
                "safetensors refuses the file",
                hint=_CORRUPT,
            )
        end, previous = info.data_offsets[1], info.key
    if end != data_size:
        raise CheckpointReadError(
            f"{path}: the tensors cover {end} of the {data_size} data bytes; "
            "safetensors refuses a file with bytes no tensor covers",
            hint=_CORRUPT,
        )


def _tensor_info(path: Path, key: str, entry: Any, data_size: int) -> TensorInfo:
    bad = CheckpointReadError(f"{path}: malformed header entry for tensor {key!r}", hint=_CORRUPT)
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
    if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise CheckpointReadError(
            f"{path}: tensor {key!r} points outside the file or has the wrong byte size",
            hint="the file is truncated or corrupt; copy it again from the source",
        )
    return TensorInfo(key, dtype, tuple(shape), (begin, end))


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
    ] = ()  # tolerant scans: (file name, what was wrong with it)

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
    headers: dict[str, SafetensorsHeader] = {}
    problems: list[tuple[str, KvcalibError]] = []
    for name in files:
        try:
            headers[name] = read_safetensors_header(ckpt_dir / name)
        except KvcalibError as exc:
            if not tolerant:
                raise
            problems.append((name, exc))
    try:
        index = _read_index(ckpt_dir / INDEX_FILENAME)
    except KvcalibError as exc:
        if not tolerant:
            raise
        index = None
        problems.append((INDEX_FILENAME, exc))
    key_files: dict[str, list[str]] = {}
    for name, header in headers.items():
        for key in header.tensors:
            key_files.setdefault(key, []).append(name)
    return CheckpointFiles(
        ckpt_dir,
        files,
        headers,
        index,
        {k: tuple(v) for k, v in key_files.items()},
        tuple(problems),
    )


def _read_index(path: Path) -> dict[str, Any] | None:
    """The safetensors index, if there is one: an object whose weight_map is an object."""
    if not path.exists():
        return None
    index = read_json(path, "safetensors index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        what = "its weight_map" if isinstance(index, dict) else "the index"
        raise CheckpointReadError(
            f"{path.name}: {what} is not a JSON object: an index-based loader cannot use it",
            hint="restore the index from the original checkpoint, or delete it if all "
            "weights are in one file",
        )
    return index


def read_tensor(header: SafetensorsHeader, key: str) -> Any:
    """One tensor of a parsed file, read at its offsets (a torch tensor). Unlike `load_tensors`, it needs only
    what `read_safetensors_header` checked, so it also reads files safetensors would refuse for other reasons."""
    import torch

    info = header.tensors[key]
    dtype = getattr(torch, torch_dtype_name(info.dtype), None)
    if dtype is None:
        raise CheckpointReadError(
            f"{header.path}: tensor {key!r} has dtype {info.dtype}, which this torch cannot read",
            hint="upgrade torch, or store the tensor in a common dtype",
        )
    raw = bytearray(_read_raw(header, key, info.nbytes))
    return (
        torch.frombuffer(raw, dtype=dtype).reshape(info.shape)
        if raw
        else torch.empty(info.shape, dtype=dtype)
    )


def _read_raw(header: SafetensorsHeader, key: str, nbytes: int) -> bytes:
    """The first `nbytes` of tensor `key`'s data; CheckpointReadError when the file cannot give them."""
    try:
        with open(header.path, "rb") as f:
            f.seek(header.data_start + header.tensors[key].data_offsets[0])
            raw = f.read(nbytes)
    except OSError as exc:
        raise CheckpointReadError(
            f"cannot read {header.path}: {exc.strerror or exc}", hint=_PERMISSIONS
        ) from None
    if len(raw) != nbytes:
        raise _eof(header, key)
    return raw


def _eof(header: SafetensorsHeader, key: str) -> CheckpointReadError:
    return CheckpointReadError(
        f"{header.path}: unexpected end of file reading tensor {key!r}", hint=_CUT
    )


# struct formats of the dtypes a scalar is read from without torch (the FP8 ones need it)
_STRUCT = {
    "F64": "<d",
    "F32": "<f",
    "F16": "<e",
    "I64": "<q",
    "I32": "<i",
    "I16": "<h",
    "I8": "<b",
    "U64": "<Q",
    "U32": "<I",
    "U16": "<H",
    "U8": "<B",
    "BOOL": "<?",
}


def read_values(header: SafetensorsHeader, key: str, count: int | None = None) -> list[float]:
    """The first `count` elements (None: all) of one tensor as floats, read with `struct` (torch only for FP8)."""
    info = header.tensors[key]
    size = DTYPE_SIZES[info.dtype]
    count = info.nbytes // size if count is None else count
    if info.dtype not in _STRUCT and info.dtype != "BF16":
        return [float(x) for x in read_tensor(header, key).reshape(-1)[:count].double().tolist()]
    raw = _read_raw(header, key, size * count)
    if count < 1 or info.nbytes < size * count:
        raise _eof(header, key)
    if info.dtype == "BF16":  # the top half of a float32
        return [
            float(struct.unpack("<f", b"\0\0" + raw[i : i + 2])[0]) for i in range(0, len(raw), 2)
        ]
    return [float(x[0]) for x in struct.iter_unpack(_STRUCT[info.dtype], raw)]


def load_tensors(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in keys}


def read_scale_values(
    ckpt_dir: Path, files: CheckpointFiles, key: str, required: bool = True
) -> list[float] | None:
    """Every value of scale `key` where a loader finds it (None if absent and not `required`; else an error)."""
    name = files.file_of(key)
    if name is None or name not in files.headers or key not in files.headers[name].tensors:
        if not required:
            return None
        raise CheckpointReadError(
            f"{ckpt_dir}: no KV scale {key}",
            hint=f"run `kvcalib validate {ckpt_dir}`; calibrate it with `kvcalib calibrate`",
        )
    values = read_values(files.headers[name], key)
    if not values:
        raise CheckpointReadError(
            f"{ckpt_dir}: {key} is empty", hint=f"run `kvcalib validate {ckpt_dir}`"
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

    def stored_dtype(self) -> str | None:
        """What `from_pretrained(dtype="auto")` picks: config's dtype, else the first floating tensor's."""
        name = self.config.get("dtype") or self.config.get("torch_dtype")
        if isinstance(name, str) and name in {torch for _size, torch in _DTYPES.values()}:
            return name
        return next(
            (
                torch_dtype_name(info.dtype)
                for file in self.files.files
                for info in self.files.headers[file].tensors.values()
                if info.dtype in FLOAT_DTYPES
            ),
            None,
        )

    def stored_float_dtypes(self) -> list[str]:
        return sorted(
            {
                torch_dtype_name(info.dtype)
                for header in self.files.headers.values()
                for info in header.tensors.values()
                if info.dtype in FLOAT_DTYPES
            }
        )

    def weight_bytes(self, element_size: int | None) -> int:
        """Bytes the tensors take with floating ones at `element_size` (None: as stored)."""
        return sum(
            info.nbytes // DTYPE_SIZES[info.dtype] * element_size
            if element_size is not None and info.dtype in FLOAT_DTYPES
            else info.nbytes
            for header in self.files.headers.values()
            for info in header.tensors.values()
        )
