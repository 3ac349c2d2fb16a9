"""Checkpoint integrity (CKPT-*) as both Neuron loader variants see it: one globs every top-level `*.safetensors`
file, the other reads only the index's `weight_map`. Headers and index only; never raises."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvcalib.core.checkpoint import CheckpointFiles, scan_checkpoint
from kvcalib.core.schema import INDEX_FILENAME, SINGLE_WEIGHTS_FILENAME, is_kv_scale_key
from kvcalib.validation.report import ERROR, WARNING, Finding, short_repr

__all__ = ["scan_for_validation"]

_EXAMPLES = 3


def _examples(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:_EXAMPLES]) + (
        f", ... ({len(keys)} in all)" if len(keys) > _EXAMPLES else ""
    )


def scan_for_validation(root: Path) -> tuple[CheckpointFiles, list[Finding]]:
    """Read every header and the index (tolerant); report what cannot be read or does not agree."""
    scan = scan_checkpoint(root, tolerant=True)
    findings = [
        Finding(
            "CKPT-INDEX-UNREADABLE" if name == INDEX_FILENAME else "CKPT-HEADER",
            ERROR,
            exc.message,
            exc.hint,
            name,
        )
        for name, exc in scan.problems
    ]
    if not scan.files and not (root / INDEX_FILENAME).exists():
        findings.append(
            Finding(
                "CKPT-NO-SAFETENSORS",
                ERROR,
                f"no *.safetensors file in {root}: the Neuron loaders read safetensors only",
                "convert the weights to safetensors (save_pretrained(..., safe_serialization=True))",
                str(root),
            )
        )
    by_files = {}
    for key, names in scan.key_files.items():
        if len(names) > 1:
            by_files.setdefault(names, []).append(key)
    findings += [
        Finding(
            "CKPT-DUPLICATE-KEY",
            ERROR,
            f"{_examples([k for k in keys if is_kv_scale_key(k)] or keys)} stored "
            f"in more than one file ({', '.join(names)}): which copy a loader uses is not defined",
            "keep each tensor in exactly one file",
            ", ".join(names),
        )
        for names, keys in sorted(by_files.items())
    ]
    if scan.index is not None:
        weight_map = scan.index["weight_map"]
        location = f"{INDEX_FILENAME}:weight_map"
        by_file = {}
        for key, name in weight_map.items():
            by_file.setdefault(name if isinstance(name, str) else short_repr(name), []).append(key)
        for name, keys in by_file.items():  # a bare name: no directory, drive (":") or leading "."
            if (
                not name.endswith(".safetensors")
                or name.startswith(".")
                or any(c in name for c in "/\\:")
            ):
                findings.append(
                    Finding(
                        "CKPT-INDEX-FILE-NAME",
                        ERROR,
                        f"weight_map names {name!r} for {_examples(keys)}: an index-based "
                        "loader accepts only bare top-level *.safetensors file names and refuses the checkpoint",
                        "move the file next to config.json and map its keys to its bare file name",
                        location,
                    )
                )
            elif not os.path.isfile(
                scan.root / name
            ):  # False for a name too long, or with a NUL byte
                findings.append(
                    Finding(
                        "CKPT-INDEX-FILE-MISSING",
                        ERROR,
                        f"weight_map names {name!r}, which does not exist, for "
                        f"{_examples(keys)}: an index-based loader refuses the checkpoint",
                        "restore the missing file, or rebuild the index from the files present",
                        location,
                    )
                )
            elif name in scan.headers:
                stale = [key for key in keys if key not in scan.headers[name].tensors]
                findings += _per_key_or_file(
                    "CKPT-INDEX-KEY-STALE",
                    stale,
                    name,
                    f"weight_map maps {{keys}} to {name}, which holds no such "
                    "tensor: an index-based loader cannot find it",
                    "rebuild weight_map from the safetensors headers",
                )
        for name, header in scan.headers.items():
            findings += _per_key_or_file(
                "CKPT-INDEX-KEY-UNMAPPED",
                [key for key in header.tensors if key not in weight_map],
                name,
                f"{{keys}} in {name} is missing from weight_map: loaders that glob *.safetensors read "
                "it, index-based loaders silently ignore it (a scale missing there runs at 1.0)",
                f"add every key of {name} to weight_map with the bare file name {name!r}",
            )
        # CKPT-TOTAL-SIZE: metadata.total_size against the bytes of the tensors in weight_map (an unreadable or
        # missing file: reported above, no size to compare)
        metadata = scan.index.get("metadata")
        total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
        location = f"{INDEX_FILENAME}:metadata.total_size"
        headers = [scan.headers.get(n) if isinstance(n, str) else None for n in weight_map.values()]
        actual = None
        if None not in headers:
            actual = sum(h.tensors[k].nbytes for k, h in zip(weight_map, headers) if k in h.tensors)
        if total_size is not None and (type(total_size) is not int):
            findings.append(
                Finding(
                    "CKPT-TOTAL-SIZE",
                    WARNING,
                    f"metadata.total_size is {short_repr(total_size)}, not an integer",
                    "set it to the sum of the byte sizes of the tensors in weight_map",
                    location,
                )
            )
        elif total_size is not None and actual not in (None, total_size):
            findings.append(
                Finding(
                    "CKPT-TOTAL-SIZE",
                    WARNING,
                    f"metadata.total_size is {total_size}, but the tensors in weight_map hold {actual} bytes",
                    f"set metadata.total_size to {actual}",
                    location,
                )
            )
        # transformers loads a top-level model.safetensors and never reads the index beside it
        shadowed = sorted(
            k for k, files in scan.key_files.items() if SINGLE_WEIGHTS_FILENAME not in files
        )
        if SINGLE_WEIGHTS_FILENAME in scan.headers and shadowed:
            scales = [k for k in shadowed if is_kv_scale_key(k)]
            findings.append(
                Finding(
                    "CKPT-SINGLE-FILE-SHADOWS-INDEX",
                    WARNING,
                    f"{SINGLE_WEIGHTS_FILENAME} exists beside {INDEX_FILENAME}: transformers (and "
                    f"compressed-tensors through it) loads only {SINGLE_WEIGHTS_FILENAME} and ignores "
                    f"{_examples(scales or shadowed)} in other files; vLLM and the Neuron loaders are not affected",
                    f"rename {SINGLE_WEIGHTS_FILENAME} to model-00001-of-00001.safetensors and update weight_map "
                    "(kvcalib calibrate writes this layout)",
                    SINGLE_WEIGHTS_FILENAME,
                )
            )
    return scan, findings


def _per_key_or_file(
    rule: str, keys: list[str], name: str, message: str, hint: str
) -> list[Finding]:
    """An error per KV-scale key (those decide the numerics); one warning for a file's other keys."""
    scale_keys, other = (
        sorted(k for k in keys if is_kv_scale_key(k)),
        [k for k in keys if not is_kv_scale_key(k)],
    )
    findings = [
        Finding(rule, ERROR, message.replace("{keys}", key), hint, f"{name}:{key}")
        for key in scale_keys
    ]
    if other:
        findings.append(
            Finding(rule, WARNING, message.replace("{keys}", _examples(other)), hint, name)
        )
    return findings
