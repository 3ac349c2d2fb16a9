"""The layering is enforced, not claimed: import-linter's contracts (pyproject.toml) hold on the package, a wrong
import in a scratch copy breaks them, and the light entry points load no torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter is not installed: pip install -e '.[dev]'"
)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports with the contracts of `root`/pyproject.toml on the package under `root` (first on the path)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


# (the module given a wrong import, the import, what lint-imports reports for it)
WRONG_IMPORTS = [
    (
        "kvcalib/core/errors.py",
        "import kvcalib.hf.model",
        "kvcalib.core.errors -> kvcalib.hf.model",
    ),
    (
        "kvcalib/evaluation/scales.py",
        "from kvcalib.serving import launch",
        "kvcalib.evaluation.scales -> kvcalib.serving.launch",
    ),
    ("kvcalib/validation/files.py", "import torch", "kvcalib.validation.files -> torch"),
    ("kvcalib/hf/data.py", "import rich", "-> kvcalib.hf.data"),
]


def test_a_wrong_import_breaks_them(tmp_path):
    """Each wrong import in one scratch copy (one lint-imports run): every contract broken, each import named."""
    shutil.copytree(
        REPO / "kvcalib", tmp_path / "kvcalib", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    for module, line, _ in WRONG_IMPORTS:
        path = tmp_path / module
        path.write_text(
            path.read_text(encoding="utf-8") + f"\n{line}  # the wrong import\n", encoding="utf-8"
        )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 3 broken" in result.stdout, result.stdout
    for _, _, reported in WRONG_IMPORTS:
        assert reported in result.stdout, (reported, result.stdout)
    assert "is not allowed to import rich" in result.stdout, result.stdout


def test_the_light_entry_points_load_no_torch():
    """validate, serve-check's server paths and the package's API namespace import without torch, transformers,
    compressed-tensors or lm-eval (each is loaded when a job needs it)."""
    probe = (
        "import sys, kvcalib, kvcalib.validation, kvcalib.serving, kvcalib.cli\n"
        "print(sorted(n for n in ('torch', 'transformers', 'compressed_tensors', 'datasets', 'lm_eval') "
        "if n in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]", result.stdout
