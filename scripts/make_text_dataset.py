#!/usr/bin/env python3
"""Write a dataset (JSON lines, a `text` column) from real prose on this machine.

--source fortunes (default): Debian's `fortunes` package (apt-get install fortunes), ~2.4 MB
of short prose, entries separated by a line holding `%`.
--source python-tutorial: the Python tutorial from Debian's `python3.11-doc` package, split
into paragraphs; held-out text for `kvcalib eval` of a model calibrated on fortunes.
Consecutive entries are joined into samples of about --chars characters, so sequences are
long enough to exercise many positions.

    python scripts/make_text_dataset.py OUT.jsonl [--source fortunes] [--chars 2000] [--max-rows 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORTUNES_DIR = Path("/usr/share/games/fortunes")
TUTORIAL_DIR = Path("/usr/share/doc/python3.11/html/_sources/tutorial")


def tutorial_paragraphs(directory: Path = TUTORIAL_DIR) -> list[str]:
    files = sorted(directory.glob("*.rst.txt")) if directory.is_dir() else []
    paragraphs = [
        p.strip()
        for path in files
        for p in path.read_text(encoding="utf-8").split("\n\n")
        if p.strip()
    ]
    if not paragraphs:
        sys.exit(f"no tutorial found under {directory}: run `apt-get install python3.11-doc` first")
    return paragraphs


def fortune_entries(directory: Path = FORTUNES_DIR) -> list[str]:
    entries: list[str] = []
    files = (
        sorted(p for p in directory.iterdir() if p.is_file() and p.suffix == "")
        if directory.is_dir()
        else []
    )
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        entries.extend(e.strip() for e in text.split("\n%\n") if e.strip())
    if not entries:
        sys.exit(f"no fortunes found under {directory}: run `apt-get install fortunes` first")
    return entries


def join_entries(entries: list[str], chars: int, max_rows: int) -> list[str]:
    rows: list[str] = []
    current: list[str] = []
    size = 0
    for entry in entries:
        current.append(entry)
        size += len(entry) + 2
        if size >= chars:
            rows.append("\n\n".join(current))
            current, size = [], 0
            if len(rows) >= max_rows:
                break
    if current and len(rows) < max_rows:
        rows.append("\n\n".join(current))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", choices=["fortunes", "python-tutorial"], default="fortunes")
    parser.add_argument("--chars", type=int, default=2000)
    parser.add_argument("--max-rows", type=int, default=2000)
    args = parser.parse_args()
    entries = fortune_entries() if args.source == "fortunes" else tutorial_paragraphs()
    rows = join_entries(entries, args.chars, args.max_rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"text": row}) + "\n")
    print(f"{len(rows)} rows written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
