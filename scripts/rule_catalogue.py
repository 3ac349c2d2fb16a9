#!/usr/bin/env python3
"""Writes the catalogues generated from the code: scripts/VALIDATE_RULES.md, `kvcalib validate`'s finding codes, from
the rules as declared (kvcalib/validation/rules.py), and scripts/SERVERS.md, what each server does with an FP8 KV
cache, from kvcalib/core/servers.py and the numerics kvcalib emulates (kvcalib/core/fp8.py).
tests/validate/test_rule_catalogue.py and tests/core/test_servers.py fail while a committed file is stale.

    python scripts/rule_catalogue.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# internal: the rules and servers as declared, which these catalogues document (the repository on sys.path first)
from kvcalib.core import fp8  # noqa: E402
from kvcalib.core.servers import SERVERS  # noqa: E402
from kvcalib.validation.rules import RULES  # noqa: E402

OUT, SERVERS_OUT = REPO / "scripts" / "VALIDATE_RULES.md", REPO / "scripts" / "SERVERS.md"
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


def _numerics(name: str) -> str:
    if not name:
        return (
            "MXFP8 (kvcalib.core.mxfp8): E4M3FN, an E8M0 scale per 32 values, no per-tensor scale"
        )
    t = fp8.get_target(name)
    cast = "toward zero" if t.toward_zero else "to nearest even"
    product = ", the product rounded to bf16 before the cast" if t.bf16_product else ""
    return f"{t.dtype}, clamped at ±{t.fp8_max:g}, cast {cast}; the scale applied as {t.scaling}{product}"


def render_servers() -> str:
    """The page as Markdown: one section per server, in the table's order."""
    lines = [
        "# What each server does with an FP8 KV cache",
        "",
        f"Generated from kvcalib/core/servers.py by scripts/rule_catalogue.py; regenerate with `{COMMAND}`. "
        "s is the checkpoint's scale (x ≈ fp8 x s), m the multiplier vLLM Neuron keeps for it.",
    ]
    for server in SERVERS:
        lines += [
            "",
            f"## {server.name}",
            "",
            "| | |",
            "| --- | --- |",
            f"| kvcalib emulates | {_numerics(server.numerics)}; `kvcalib eval --order {server.order}` |",
            f"| write | {server.write} |",
            f"| read | {server.read} |",
            f"| prefill order | {server.prefill} |",
            f"| scales it loads | {server.scales} |",
            f"| source | {server.source} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for out, text in ((OUT, render()), (SERVERS_OUT, render_servers())):
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
