"""The real models' held-out and calibration text (module-scoped: each test file writes its own)."""

from __future__ import annotations

import pytest
from helpers import fortune_texts, tutorial_texts, write_jsonl


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """Held-out text: the Python tutorial."""
    path = tmp_path_factory.mktemp("tutorial") / "tutorial.jsonl"
    return write_jsonl(path, [{"text": t} for t in tutorial_texts(8)])


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    path = tmp_path_factory.mktemp("prose") / "fortunes.jsonl"
    return write_jsonl(path, [{"text": t} for t in fortune_texts(24, chars=800)])
