"""The documents a newcomer reads: short, without history, their links and commands real, --help readable at 80."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "scripts").glob("*.md")),
    *sorted((REPO / "recipes").glob("*.md")),
]
DIARY = re.compile(
    r"this session|last session|measured and not kept|an hour later|found on the way|"
    r"\bwas [0-9.,]+ ?s\b",
    re.IGNORECASE,
)


def test_the_readme_fits_in_300_lines_and_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    opening = "\n".join(lines[:6])
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in opening and (REPO / script).is_file()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_diary_and_every_relative_link_resolves(doc):
    text = doc.read_text()
    assert not DIARY.findall(text), f"{doc.name}: history belongs in the closing note, not the docs"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (doc.parent / target).exists(), (
                f"{doc.name} links to {target}, which does not exist"
            )


@pytest.mark.parametrize(
    "command",
    ["calibrate", "eval", "eval-context", "eval-needle", "eval-tasks", "serve-check", "validate"],
)
def test_help_is_readable_at_80_columns(command, monkeypatch):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    width = {"COLUMNS": "80", "TERMINAL_WIDTH": "80", "NO_COLOR": "1"}
    for (
        key,
        value,
    ) in width.items():  # rich reads the width when the console is made, in this process
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    # typer reads TERMINAL_WIDTH once, when typer.rich_utils is imported: whichever test of this process came first
    monkeypatch.setattr("typer.rich_utils.MAX_WIDTH", 80)
    result = CliRunner().invoke(app, [command, "--help"], env=width)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "…" not in out  # no option name or help cut off
    assert max(len(line) for line in out.splitlines()) <= 80
    if command == "calibrate":
        for choices in ("trn2|trn3|gpu", "attention|absmax"):
            assert choices in out.replace(
                "\n", ""
            )  # --target and --scale-objective list their choices


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_a_doc_names_is_there_or_at_its_commit(doc):
    """A script removed from scripts/ is named with the commit where it lives (`git show COMMIT:scripts/X.py`)."""
    text = doc.read_text()
    for name in set(re.findall(r"scripts/(\w+\.(?:py|sh))", text)):
        assert (REPO / "scripts" / name).is_file() or re.search(
            rf"git show [0-9a-f]{{7,40}}:scripts/{name}", text
        ), f"{doc.name} names scripts/{name}, which is not there"
