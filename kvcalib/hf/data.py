"""Calibration data: a dataset (local files, a saved dataset, or a hub id) -> token sequences.

As llm-compressor's example selects them: the first N rows of the split, shuffled with the seed, truncated to
max_seq_len; a `messages` column is rendered with the chat template. Tokens are what vLLM sees: plain text with the
tokenizer's default special tokens, chat text with none; `add_special_tokens` True or False overrides that per row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from kvcalib.core.errors import DatasetError
from kvcalib.core.paths import require_regular_file

__all__ = [
    "CalibrationData",
    "batched",
    "batches",
    "leading_special_tokens",
    "load_calibration_data",
    "load_rows",
    "resolve_column",
    "SPECIAL_TOKENS_RULES",
    "tokenize_as_served",
]

# file suffix -> datasets' packaged builder
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_SAVED = ("dataset_info.json", "dataset_dict.json", "state.json")  # what save_to_disk writes


@dataclass(frozen=True)
class CalibrationData:
    """Token sequences to calibrate on, and where they came from."""

    sequences: tuple[tuple[int, ...], ...]
    source: str
    split: str
    column: str
    rows_selected: int
    rows_empty: int  # rows that tokenised to nothing (skipped)
    special_tokens: tuple[
        int, ...
    ] = ()  # what the tokenizer added to the plain-text rows (e.g. BOS)
    special_tokens_rule: str = ""  # how rows were tokenised (SPECIAL_TOKENS_RULES)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def longest(self) -> int:
        return max((len(s) for s in self.sequences), default=0)


def load_rows(dataset: str, split: str):
    """A `datasets.Dataset` for `dataset` (path or hub id) and `split`."""
    import datasets

    path = Path(dataset).expanduser()
    try:
        if path.is_dir() and any((path / name).exists() for name in _SAVED):
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict) and split not in saved:
                raise DatasetError(
                    f"dataset {dataset} has no split {split!r}; it has {sorted(saved)}",
                    hint="pass one of them with --split",
                )
            return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
        # a directory's data files (_load_files refuses an entry with a data suffix that is no regular file)
        if path.is_dir():
            found = [
                e
                for e in sorted(path.rglob("*"))
                if e.suffix.lower() in BUILDERS and not e.is_dir()
            ]
            if not found:
                raise DatasetError(
                    f"no data files in {path}",
                    hint=f"put {', '.join(sorted(BUILDERS))} files "
                    "there, or a dataset saved with save_to_disk",
                )
            return _load_files(found, split)
        if os.path.lexists(path):
            return _load_files([path], split)
        if dataset.startswith((".", "/", "~")) or path.suffix.lower() in BUILDERS:
            raise DatasetError(f"dataset not found: {dataset}", hint="check the path")
        return datasets.load_dataset(dataset, split=split)
    except DatasetError:
        raise
    except (
        Exception
    ) as exc:  # datasets raises its own families too (DatasetGenerationError, hub errors)
        ours = {"datasets", "huggingface_hub", "pyarrow", "requests", "httpx"}
        if not isinstance(exc, (ValueError, OSError, KeyError)) and (
            type(exc).__module__.split(".")[0] not in ours
        ):
            raise
        cause = exc.__cause__ or exc.__context__
        raise DatasetError(
            f"cannot read dataset {dataset} (split {split!r}): {exc}"
            + (f" ({cause})" if cause is not None else ""),
            hint="pass a local .txt/.jsonl/.json/.parquet/.csv file or directory (each file well-formed: one JSON "
            "object per line in .jsonl, a header row in .csv), a save_to_disk directory, or a hub dataset id on "
            "a machine that is online",
        ) from None


def _load_files(files: list[Path], split: str):
    import datasets

    for path in files:
        require_regular_file(
            path,
            "dataset file",
            error=DatasetError,
            missing=DatasetError,
            hint=f"pass {', '.join(sorted(BUILDERS))} files, or a dataset saved with save_to_disk",
        )
    suffixes = {p.suffix.lower() for p in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) > 1:
        raise DatasetError(
            f"unsupported or mixed dataset file types {sorted(suffixes)} ({files[0]})",
            hint=f"keep one file type per dataset directory, one of {', '.join(sorted(BUILDERS))}",
        )
    if split != "train":
        raise DatasetError(
            f"local data files have only the split 'train', not {split!r}",
            hint="drop --split, or save a DatasetDict with save_to_disk to keep named splits",
        )
    (builder,) = builders
    for path in files:
        _check_file(path)
    ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
    if builder == "text":  # one row per line; blank lines are no samples
        ds = ds.filter(lambda row: bool(row["text"].strip()))
    return ds


def _check_file(path: Path) -> None:
    """Read what datasets' builders report badly (or with a traceback): an empty file, a bad JSON line."""
    one_object = 'each line of a .jsonl file is one JSON object, e.g. {"text": "..."}'
    try:
        with open(path, "rb") as f:
            if path.suffix.lower() != ".jsonl":
                if not f.read(1):
                    raise DatasetError(
                        f"dataset file {path} is empty", hint="pass a file with text in it"
                    )
                return
            rows = 0
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise DatasetError(
                        f"{path}: line {number} is not valid JSON ({exc})", hint=one_object
                    ) from None
                if not isinstance(row, dict):
                    raise DatasetError(
                        f"{path}: line {number} is a JSON {type(row).__name__}, not an object",
                        hint=one_object,
                    )
                rows += 1
    except OSError as exc:
        raise DatasetError(
            f"cannot read dataset file {path}: {exc.strerror or exc}",
            hint="check the file's permissions",
        ) from None
    if rows == 0:
        raise DatasetError(
            f"dataset file {path} has no rows (it is empty or blank)",
            hint='pass a .jsonl file with one JSON object per line, e.g. {"text": "..."}',
        )


def resolve_column(column_names: list[str], text_column: str | None, source: str) -> str:
    """The column to read: the one asked for, else `text`, else `messages`."""
    if text_column is not None:
        if text_column not in column_names:
            raise DatasetError(
                f"dataset {source} has no column {text_column!r}; it has {column_names}",
                hint="pass one of them with --text-column",
            )
        return text_column
    for candidate in ("text", "messages"):
        if candidate in column_names:
            return candidate
    raise DatasetError(
        f"dataset {source} has no 'text' or 'messages' column; it has {column_names}",
        hint="name the text column with --text-column",
    )


def load_calibration_data(dataset: str, tokenizer: Any, opts: Any) -> CalibrationData:
    """Select, render and tokenise calibration samples (see the module docstring) as `opts` (a RunOptions with
    num_samples and max_seq_len: calibrate's or eval's) say."""
    import datasets

    split, add_special_tokens = opts.split, opts.add_special_tokens

    ds = load_rows(dataset, split)
    column = resolve_column(list(ds.column_names), opts.text_column, dataset)
    if len(ds) == 0:
        raise DatasetError(
            f"dataset {dataset} (split {split!r}) has no rows",
            hint="pass a dataset with text in it",
        )
    ds = ds.select(range(min(opts.num_samples, len(ds))))
    rendered = [
        _render(row, column, tokenizer, dataset, number)
        for number, row in enumerate(ds[column], start=1)
    ]
    # the order ds.shuffle(seed=seed) gives, as llm-compressor's
    order = datasets.Dataset.from_dict({"row": list(range(len(rendered)))}).shuffle(seed=opts.seed)[
        "row"
    ]
    texts, chat = zip(*(rendered[i] for i in order))
    encoded = tokenize_as_served(tokenizer, texts, chat, opts.max_seq_len, add_special_tokens)
    sequences = tuple(tuple(ids) for ids in encoded if ids)
    if not sequences:
        raise DatasetError(
            f"dataset {dataset}: all {len(texts)} selected rows of column {column!r} are empty",
            hint="pass a dataset with text in it",
        )
    bare, full = _bare_and_full(
        tokenizer
    )  # the ids the tokenizer adds around plain text (BOS, EOS ...)
    added = (
        tuple(i for i in full if i not in bare)
        if add_special_tokens is not False and not all(chat)
        else ()
    )
    return CalibrationData(
        sequences,
        dataset,
        split,
        column,
        len(texts),
        len(texts) - len(sequences),
        added,
        SPECIAL_TOKENS_RULES[add_special_tokens],
    )


# add_special_tokens -> the provenance's words for how the rows were tokenised
SPECIAL_TOKENS_RULES = {
    None: "as served: plain text with the tokenizer's default special tokens, chat-template text with none",
    True: "every row with the tokenizer's special tokens",
    False: "no special tokens added",
}


def tokenize_as_served(
    tokenizer: Any,
    texts: list[str],
    chat: list[bool],
    max_seq_len: int,
    add_special_tokens: bool | None = None,
) -> list[list[int]]:
    """Token ids of each text as vLLM sends it (module docstring); an empty text stays empty."""
    return [
        list(
            tokenizer(
                text,
                add_special_tokens=not is_chat
                if add_special_tokens is None
                else add_special_tokens,
                truncation=True,
                max_length=max_seq_len,
            )["input_ids"]
        )
        if text
        else []
        for text, is_chat in zip(texts, chat)
    ]


def _bare_and_full(tokenizer: Any) -> tuple[list[int], list[int]]:
    """A one-letter text's ids without and with the tokenizer's default special tokens."""
    return tuple(tokenizer("a", add_special_tokens=add)["input_ids"] for add in (False, True))


def leading_special_tokens(tokenizer: Any) -> tuple[int, ...]:
    """The ids the tokenizer puts before plain text by default (BOS), in order; () if none."""
    bare, full = _bare_and_full(tokenizer)
    starts = [s for s in range(len(full) - len(bare) + 1) if full[s : s + len(bare)] == bare]
    return tuple(full[: starts[0]]) if starts else ()


def _render(value: Any, column: str, tokenizer: Any, source: str, row: int) -> tuple[str, bool]:
    """The text of one row (1-based `row`, for the messages), and whether a chat template rendered it."""
    if isinstance(value, str):
        return value, False
    if value is None or (isinstance(value, list) and not value):
        return "", False
    where = f"{source}: row {row}, column {column!r}"
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(
                f"{where} holds chat messages but the model has no chat template",
                hint="pass a text column with --text-column",
            )
        hint = 'a chat message is {"role": "user", "content": "..."}, both strings'
        for number, message in enumerate(value, start=1):
            for key in ("role", "content"):
                if message.get(key) is None:  # datasets fills a key other rows have with None
                    raise DatasetError(f"{where}, message {number} has no {key!r}", hint=hint)
                if not isinstance(message[key], str):
                    raise DatasetError(
                        f"{where}, message {number}: {key!r} is {type(message[key]).__name__}, not a string",
                        hint=hint,
                    )
        try:
            return tokenizer.apply_chat_template(value, tokenize=False), True
        except Exception as exc:  # noqa: BLE001 -- jinja2's errors, or the template's own raise_exception
            raise DatasetError(
                f"{where}: the model's chat template refuses these messages ({exc})",
                hint="each message needs a 'role' the template knows and string 'content'",
            ) from None
    kind = "a list of non-messages" if isinstance(value, list) else type(value).__name__
    raise DatasetError(
        f"{where} holds {kind}, not text or chat messages",
        hint="name a text column with "
        '--text-column, or give chat rows as [{"role": ..., "content": ...}]',
    )


def batched(
    sequences: tuple[tuple[int, ...], ...], batch_size: int
) -> list[tuple[tuple[int, ...], ...]]:
    """The sequences in batches, longest first to waste little padding."""
    order = sorted(sequences, key=len, reverse=True)
    return [tuple(order[start : start + batch_size]) for start in range(0, len(order), batch_size)]


def batches(
    sequences: tuple[tuple[int, ...], ...], batch_size: int, pad_id: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask) batches (`batched`)."""
    for chunk in batched(sequences, batch_size):
        ids = pad_sequence([torch.tensor(s) for s in chunk], batch_first=True, padding_value=pad_id)
        lengths = torch.tensor([len(s) for s in chunk])
        yield ids, (torch.arange(ids.shape[1]) < lengths[:, None]).long()
