"""kvcalib as users install it: a wheel built from this tree, installed (not editable) into a fresh virtual
environment, runs `kvcalib --version`, validates a checkpoint and calibrates with a recipe it ships (`--recipe trn2`).

The new environment holds kvcalib alone; its dependencies come from the test environment's site-packages, as a
path (no .pth file there runs, so the editable kvcalib of the test environment stays out of reach), so nothing is
downloaded. The test checks that the kvcalib that ran is the installed one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvcalib._version import __version__

REPO = Path(__file__).resolve().parent.parent


def run(argv: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(cwd),
        "COLUMNS": "240",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(cwd / "datasets-cache"),
    }
    return subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv with the wheel of this tree installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    try:
        import setuptools  # noqa: F401  -- the build backend, from the test environment (no download)
    except ImportError:
        pytest.skip(
            "setuptools is not installed in the test environment: the wheel cannot be built offline"
        )
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    assert build.returncode == 0, build.stderr
    [wheel] = (tmp / "dist").glob("kvcalib-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"kvcalib/recipes/kv-fp8-{t}.yaml" for t in ("trn2", "trn3", "gpu")} <= set(names), (
        names
    )
    assert (
        any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        and "kvcalib/py.typed" in names
    )
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    site = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp
    ).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "test-environment-deps.pth").write_text(
        "\n".join(sorted(deps)) + "\n", encoding="utf-8"
    )
    return venv / "bin"


def test_the_installed_wheel_runs(installed, tiny_llama_master, text_dataset, tmp_path):
    where = run(
        [
            installed / "python",
            "-c",
            "import kvcalib, kvcalib.calibration.recipe as r; "
            "print(kvcalib.__file__); print(r.recipe_file('trn2'))",
        ],
        tmp_path,
    )
    assert where.returncode == 0, where.stderr
    module, recipe = where.stdout.split()
    assert Path(module).is_relative_to(installed.parent) and "site-packages" in module, module
    assert Path(recipe).is_relative_to(installed.parent) and Path(recipe).is_file(), recipe

    version = run([installed / "kvcalib", "--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"kvcalib {__version__}", (
        version.stdout + version.stderr
    )

    out = tmp_path / "out"
    calibrated = run(
        [
            installed / "kvcalib",
            "calibrate",
            tiny_llama_master,
            "--dataset",
            text_dataset,
            "-o",
            out,
            "--recipe",
            "trn2",
            "--num-samples",
            "4",
            "--max-seq-len",
            "32",
            "--json",
        ],
        tmp_path,
    )
    assert calibrated.returncode == 0, calibrated.stderr
    assert json.loads(calibrated.stdout)["target"] == "trn2"
    provenance = json.loads((out / "kvcalib_calibration.json").read_text(encoding="utf-8"))
    assert Path(provenance["recipe"]) == Path(recipe) and provenance["target"] == "trn2", provenance

    validated = run(
        [installed / "kvcalib", "validate", out, "--target", "trn2", "--json"], tmp_path
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert json.loads(validated.stdout)["ok"] is True
    for_gpu = run([installed / "kvcalib", "validate", out, "--target", "gpu", "--json"], tmp_path)
    assert "ok" in json.loads(for_gpu.stdout), (
        for_gpu.stderr
    )  # it reads vllm_scales.json, shipped in the wheel
