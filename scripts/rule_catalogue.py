#!/usr/bin/env python3
"""Writes scripts/VALIDATE_RULES.md, the catalogue of `kvcalib validate`'s finding codes, from the rules as declared
(kvcalib/validation/rules.py). tests/validate/test_rule_catalogue.py fails while the committed file is stale.

    python scripts/rule_catalogue.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# internal: the rules as declared, which this catalogue documents (the repository on sys.path first)
from kvcalib.validation.rules import RULES  # noqa: E402

OUT = REPO / "scripts" / "VALIDATE_RULES.md"
COMMAND = "python scripts/rule_catalogue.py"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The catalogue as Markdown: one table per group, in the order the rules are declared."""
    lines = [
        "# `kvcalib validate`: finding codes",
        "",
        f"Generated from kvcalib/validation/rules.py by scripts/rule_catalogue.py; regenerate with `{COMMAND}`.",
    ]
    for group, rules in RULES.items():
        lines += [
            "",
            f"## {group}",
            "",
            "| code | severity | what it catches | follows |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| `{r.code}` | {_cell(r.severity)} | {_cell(r.catches)} | {_cell(r.follows)} |"
            for r in rules
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
