"""A checkpoint's safetensors tensors by name, across its files, as the plugin's loaders look them up
(vllm_neuron/utils/checkpoints.py `SafetensorsCheckpoint`: `_tensor_name_to_file`, `_get_slice`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_FORMATS = {
    "F32": ("f", 4),
    "F64": ("d", 8),
    "F16": ("e", 2),
    "U8": ("B", 1),
    "I32": ("i", 4),
    "I64": ("q", 8),
}


class SafetensorsCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensor_name_to_file: dict[str, Path] = {}
        self._entries: dict[str, tuple[int, dict[str, Any]]] = {}
        for file in sorted(self.path.glob("*.safetensors")):
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for key, entry in header.items():
                if key != "__metadata__":
                    self.tensor_name_to_file[key] = file
                    self._entries[key] = (8 + n, entry)

    def get_tensor_names(self) -> list[str]:
        return list(self.tensor_name_to_file)

    def entry(self, key: str) -> dict[str, Any]:
        """dtype, shape, data_offsets; KeyError naming the tensor, as a lookup in the plugin's index fails."""
        return self._entries[key][1]

    def read(self, key: str, count: int | None = None) -> list[float]:
        """The first `count` elements (all by default) as Python numbers; bf16 widened exactly."""
        start, entry = self._entries[key]
        dtype, (begin, end) = entry["dtype"], entry["data_offsets"]
        size = 2 if dtype == "BF16" else _FORMATS[dtype][1]
        n = (end - begin) // size if count is None else min(count, (end - begin) // size)
        with open(self.tensor_name_to_file[key], "rb") as f:
            f.seek(start + begin)
            data = f.read(n * size)
        if dtype == "BF16":
            return [
                struct.unpack("<f", b"\0\0" + data[i : i + 2])[0] for i in range(0, len(data), 2)
            ]
        return list(struct.unpack(f"<{n}{_FORMATS[dtype][0]}", data))


def to_bfloat16(value: float) -> float:
    """`value` rounded to bfloat16 (nearest, ties to even), as torch's .to(torch.bfloat16) rounds."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]
