"""Shared fixtures: a tiny Llama checkpoint built in-process, real text, the real SmolLM2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import build_tiny_llama, smollm2_checkpoint, write_jsonl, fortune_texts

# Tests never reach a hub: everything they load is built here or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_llama_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Llama (float32, sharded, with a byte-level BPE tokenizer). Do not modify."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def tiny_llama(tiny_llama_master: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama that a test may change."""
    dst = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama_master, dst)
    return dst


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl file with a `text` column of real prose (Debian's fortunes, or a fallback)."""
    path = tmp_path_factory.mktemp("data") / "fortunes.jsonl"
    write_jsonl(path, [{"text": t} for t in fortune_texts(64, chars=100)])
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors checkpoint (converted once)."""
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture
def read_json():
    def _read(path: Path):
        with open(path) as f:
            return json.load(f)

    return _read
