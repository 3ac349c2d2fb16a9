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


@pytest.mark.parametrize(
    "module, line, contract",
    [
        (
            "kvcalib/core/errors.py",
            "import kvcalib.hf.model",
            "cli -> api -> calibration -> serving -> evaluation -> validation",
        ),
        (
            "kvcalib/evaluation/scales.py",
            "from kvcalib.serving import launch",
            "cli -> api -> calibration -> serving",
        ),
        (
            "kvcalib/validation/files.py",
            "import torch",
            "validation reads checkpoints without torch",
        ),
        ("kvcalib/hf/data.py", "import rich", "typer and rich belong to the command line"),
    ],
)
def test_a_wrong_import_breaks_them(tmp_path, module, line, contract):
    shutil.copytree(
        REPO / "kvcalib", tmp_path / "kvcalib", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    path = tmp_path / module
    path.write_text(
        path.read_text(encoding="utf-8") + f"\n{line}  # the wrong import\n", encoding="utf-8"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 broken" in result.stdout and contract in result.stdout, result.stdout
    assert module.removesuffix(".py").replace("/", ".") in result.stdout, result.stdout


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
