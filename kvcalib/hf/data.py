"""Calibration data: a dataset (local files, a saved dataset, or a hub id) -> token sequences.

Selection follows llm-compressor's example, so users get the same samples: the first N
rows of the split, shuffled with the seed, each truncated to max_seq_len, tokenised with
no extra special tokens. A `messages` column (chat format, as in ultrachat) is rendered
with the model's chat template first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcalib.core.errors import DatasetError

__all__ = [
    "BUILDERS", "CHAT_COLUMN", "CalibrationData", "DEFAULT_TEXT_COLUMN", "batches", "load_calibration_data",
    "load_rows", "resolve_column",
]

# file suffix -> datasets' packaged builder
BUILDERS = {
    ".txt": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
CHAT_COLUMN = "messages"
DEFAULT_TEXT_COLUMN = "text"


@dataclass(frozen=True)
class CalibrationData:
    """Token sequences to calibrate on, and where they came from."""

    sequences: tuple[tuple[int, ...], ...]
    source: str
    split: str
    column: str
    rows_selected: int
    rows_empty: int  # rows that tokenised to nothing (skipped)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def load_rows(dataset: str, split: str):
    """A `datasets.Dataset` for `dataset` (path or hub id) and `split`."""
    import datasets

    path = Path(dataset).expanduser()
    try:
        if path.is_file():
            return _load_files([path], split)
        if path.is_dir():
            if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists():
                return _pick_split(datasets.load_from_disk(str(path)), split, dataset)
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
            if not files:
                raise DatasetError(
                    f"no data files in {path}",
                    hint=f"put {', '.join(sorted(BUILDERS))} files there, or a dataset saved with save_to_disk",
                )
            return _load_files(files, split)
        if dataset.startswith((".", "/", "~")) or Path(dataset).suffix.lower() in BUILDERS:
            raise DatasetError(f"dataset not found: {dataset}", hint="check the path")
        return datasets.load_dataset(dataset, split=split)
    except DatasetError:
        raise
    except (ValueError, FileNotFoundError, OSError, KeyError) as exc:
        raise DatasetError(
            f"cannot read dataset {dataset} (split {split!r}): {exc}",
            hint="pass a local .txt/.jsonl/.json/.parquet/.csv file or directory, a save_to_disk "
            "directory, or a hub dataset id on a machine that is online",
        ) from None
    except Exception as exc:  # datasets raises its own families (DatasetGenerationError, hub errors)
        if type(exc).__module__.split(".")[0] not in {"datasets", "huggingface_hub", "pyarrow", "requests", "httpx"}:
            raise
        raise DatasetError(f"cannot read dataset {dataset} (split {split!r}): {exc}") from None


def _load_files(files: list[Path], split: str):
    import datasets

    suffixes = {p.suffix.lower() for p in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders:
        raise DatasetError(
            f"unsupported dataset file type {sorted(suffixes)} ({files[0]})",
            hint=f"use one of {', '.join(sorted(BUILDERS))}",
        )
    if len(builders) > 1:
        raise DatasetError(f"mixed dataset file types {sorted(suffixes)} under one dataset path",
                           hint="keep one file type per dataset directory")
    if split != "train":
        raise DatasetError(
            f"local data files have only the split 'train', not {split!r}",
            hint="drop --split, or save a DatasetDict with save_to_disk to keep named splits",
        )
    (builder,) = builders
    ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
    if builder == "text":  # one row per line; blank lines are no samples
        ds = ds.filter(lambda row: bool(row["text"].strip()))
    return ds


def _pick_split(obj: Any, split: str, name: str):
    import datasets

    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise DatasetError(f"dataset {name} has no split {split!r}; it has {sorted(obj)}",
                               hint="pass one of them with --split")
        return obj[split]
    return obj


def resolve_column(column_names: list[str], text_column: str | None, source: str) -> str:
    """The column to read: the one asked for, else `text`, else `messages`."""
    if text_column is not None:
        if text_column not in column_names:
            raise DatasetError(f"dataset {source} has no column {text_column!r}; it has {column_names}",
                               hint="pass one of them with --text-column")
        return text_column
    for candidate in (DEFAULT_TEXT_COLUMN, CHAT_COLUMN):
        if candidate in column_names:
            return candidate
    raise DatasetError(f"dataset {source} has no 'text' or 'messages' column; it has {column_names}",
                       hint="name the text column with --text-column")


def load_calibration_data(dataset: str, tokenizer: Any, *, split: str = "train", text_column: str | None = None,
                          num_samples: int = 512, max_seq_len: int = 2048, seed: int = 42) -> CalibrationData:
    """Select, render and tokenise calibration samples (see the module docstring)."""
    if num_samples < 1:
        raise DatasetError(f"--num-samples must be at least 1, not {num_samples}")
    if max_seq_len < 1:
        raise DatasetError(f"--max-seq-len must be at least 1, not {max_seq_len}")
    ds = load_rows(dataset, split)
    column = resolve_column(list(ds.column_names), text_column, dataset)
    if len(ds) == 0:
        raise DatasetError(f"dataset {dataset} (split {split!r}) has no rows", hint="pass a dataset with text in it")
    ds = ds.select(range(min(num_samples, len(ds)))).shuffle(seed=seed)
    texts = [_render(row, column, tokenizer, dataset) for row in ds[column]]
    encoded = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_seq_len)["input_ids"]
    sequences = tuple(tuple(ids) for ids in encoded if len(ids) > 0)
    if not sequences:
        raise DatasetError(f"dataset {dataset}: all {len(texts)} selected rows of column {column!r} are empty",
                           hint="pass a dataset with text in it")
    return CalibrationData(sequences, dataset, split, column, len(texts), len(texts) - len(sequences))


def _render(value: Any, column: str, tokenizer: Any, source: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(f"column {column!r} of {source} holds chat messages but the model has no chat template",
                               hint="pass a text column with --text-column")
        return tokenizer.apply_chat_template(value, tokenize=False)
    raise DatasetError(f"column {column!r} of {source} holds {type(value).__name__}, not text or chat messages",
                       hint="name a text column with --text-column")


def batches(sequences: tuple[tuple[int, ...], ...], batch_size: int, pad_id: int = 0
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask) batches, longest first to waste little padding."""
    order = sorted(sequences, key=len, reverse=True)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = len(chunk[0])
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        yield ids, mask
