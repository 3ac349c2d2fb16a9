"""Every result's docstring names each key of its to_json() (its command's --json), so the README need not; and
to_json itself, the one serialiser, on a record of its own.

Results come from real runs on the tiny Llama where one is cheap; the rest are built from their fields, whose
to_json() keys do not depend on the values (the optional ones are all set)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from kvcalib.calibration.options import (
    CalibrateOptions,
    CalibrationResult,
    KindScales,
    LayerScales,
)
from kvcalib.calibration.pipeline import calibrate
from kvcalib.calibration.plan import CalibrationPlan, Probe, plan_calibration
from kvcalib.core.records import to_json
from kvcalib.core.schema import KvCacheSize, kv_cache_size
from kvcalib.evaluation.context import ContextResult, ContextRow, evaluate_context
from kvcalib.evaluation.emulate import KindQuantStats, LayerQuantStats
from kvcalib.evaluation.needle import NeedleResult, evaluate_needle
from kvcalib.evaluation.options import EvalOptions
from kvcalib.evaluation.pipeline import EvalResult, RunResult, evaluate
from kvcalib.evaluation.significance import Interval, paired_bootstrap
from kvcalib.evaluation.tasks import TaskResult, TaskRow
from kvcalib.serving.canary import CanaryResult
from kvcalib.serving.pipeline import PromptResult, ServeCheckResult, ServerRun
from kvcalib.serving.predict import DeltaIntervals
from kvcalib.serving.server import KvCapacity
from kvcalib.serving.tasks import ServedTaskRow, TaskScores
from kvcalib.validation.pipeline import validate_checkpoint
from kvcalib.validation.report import Finding, ValidationReport

SMALL = {"num_samples": 2, "max_seq_len": 32}


def assert_documented(cls: type, payload: dict[str, Any]) -> None:
    """Each key of `payload` is a whole word of the class's docstring."""
    doc = cls.__doc__ or ""
    missing = [key for key in payload if not re.search(rf"\b{re.escape(key)}\b", doc)]
    assert payload and not missing, f"{cls.__name__}'s docstring does not name {missing}"


def every_field(cls: type, value: Any = 1.0, **given: Any) -> Any:
    """An instance with every field set (`value` unless `given`)."""
    return cls(**{f.name: given.get(f.name, value) for f in dataclasses.fields(cls)})


def test_calibrate_and_its_layers(tiny_llama_master, text_dataset, tmp_path):
    """attn_head with Q on GPU: every KindScales key a run can write (per head, range, choice) and "q"."""
    result = calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "out",
        CalibrateOptions(
            target="gpu", strategy="attn_head", attention_scales=True, num_samples=4, max_seq_len=32
        ),
    )
    payload = to_json(result)
    assert_documented(CalibrationResult, payload)
    assert_documented(LayerScales, payload["layers"][0])
    k, q = payload["layers"][0]["k"], payload["layers"][0]["q"]
    assert {"head_scales", "range", "choice"} <= set(k)
    assert_documented(KindScales, {**q, **k})
    assert_documented(KvCacheSize, payload["kv_cache"])


def test_calibrate_plan(tiny_llama_master, text_dataset, tmp_path):
    plan = plan_calibration(
        tiny_llama_master, str(text_dataset), tmp_path / "out", CalibrateOptions(**SMALL)
    )
    assert plan.ok
    assert_documented(CalibrationPlan, to_json(plan))
    assert_documented(Probe, to_json(plan)["probe"])


def test_validate(tiny_llama_master):
    report = validate_checkpoint(tiny_llama_master, "trn2")  # no scales: findings
    assert report.findings
    assert_documented(ValidationReport, to_json(report))
    assert_documented(Finding, to_json(every_field(Finding, "x", severity="error")))


def test_eval(calibrated, text_dataset):
    result = evaluate(calibrated, str(text_dataset), EvalOptions(compare=("unit",), **SMALL))
    payload = to_json(result)
    assert_documented(EvalResult, payload)
    assert_documented(RunResult, payload["runs"][0])
    assert_documented(Interval, payload["runs"][0]["delta_nll_interval"])
    kind = every_field(KindQuantStats)
    layer = every_field(LayerQuantStats, k=kind, v=kind, q=KindQuantStats(1.0, 1.0))
    assert_documented(LayerQuantStats, to_json(layer))
    assert_documented(KindQuantStats, dataclasses.asdict(kind))


def test_eval_context_and_needle(calibrated, text_dataset):
    context = to_json(
        evaluate_context(calibrated, str(text_dataset), (32,), EvalOptions(num_samples=1))
    )
    assert_documented(ContextResult, context)
    assert_documented(ContextRow, context["rows"][0])
    needle = evaluate_needle(
        calibrated, str(text_dataset), (300,), EvalOptions(dtype="float32"), keys=1
    )
    assert_documented(NeedleResult, to_json(needle))


def test_eval_tasks():
    interval = paired_bootstrap([0.1, 0.2, -0.1, 0.3])
    row = TaskRow(
        "task", "acc", "none", 4, True, 0.5, {"checkpoint": 0.5}, {"checkpoint": interval}
    )
    assert_documented(TaskRow, to_json(row))
    assert_documented(
        TaskResult, to_json(TaskResult("ckpt", "trn2", ("task",), (row,), ("checkpoint",), 4, 0))
    )


@pytest.mark.parametrize("cls", [PromptResult, CanaryResult, KvCapacity])
def test_serve_check_parts(cls):
    assert_documented(cls, to_json(every_field(cls, "x")))


def test_serve_check():
    interval = paired_bootstrap([0.1, 0.2, -0.1, 0.3])
    prompt = PromptResult("prompt", "output", "output", 1.0)
    canary = CanaryResult(True, 1 / 64, 3.0, 0.2, "the scales are applied")
    scores = TaskScores(0.5, 0.25, interval, "worse")
    row = ServedTaskRow("task", "acc", "none", 4, scores, scores, "trn2")
    assert_documented(ServedTaskRow, to_json(row))
    assert_documented(TaskScores, to_json(scores))
    assert_documented(DeltaIntervals, to_json(DeltaIntervals(interval, interval, interval)))
    run = ServerRun("vllm serve", "vllm.log", 1.0, (), (2.0,))
    result = ServeCheckResult(
        "ckpt", "cpu", True, (prompt,), 1.0, (), (), 240.0, 1, "0.0", {"fp8": run}, canary=canary
    )
    assert_documented(ServeCheckResult, to_json(result))


def test_kv_cache_size_with_sliding_layers():
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 8,
        "max_position_embeddings": 64,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    size = kv_cache_size(config)
    assert size.windowed is not None
    assert_documented(KvCacheSize, to_json(size))


@dataclasses.dataclass(frozen=True)
class _Part:
    sqnr_db: float
    absmax: float | None = None

    OMIT_NONE = True


@dataclasses.dataclass(frozen=True)
class _Record:
    name: str
    seconds: float
    interval: tuple[float, ...]
    costs: tuple[tuple[str, float], ...]
    k: _Part
    parts: dict[str, _Part]
    hidden: str = "x"
    key: str = "tensor"

    JSON = {
        "hidden": None,
        "k": None,
        "k_": "k",
        "range": "interval",
        "interval": None,
        "size": lambda r: len(r.name),
    }


def test_to_json_writes_the_fields_and_only_the_declared_differences():
    record = _Record(
        "abc", 1.23456, (0.5, 1.5), (("a", 0.25),), _Part(30.0), {"v": _Part(20.0, 4.0)}
    )
    assert to_json(record) == {
        "name": "abc",
        "seconds": 1.235,  # a key ending in seconds: to the millisecond
        "range": [0.5, 1.5],  # renamed: the tuple as a list
        "costs": {"a": 0.25},  # (name, value) pairs as an object
        "k_sqnr_db": 30.0,  # spread under the prefix; the None absmax left out (OMIT_NONE)
        "parts": {"v": {"sqnr_db": 20.0, "absmax": 4.0}},
        "key": "tensor",
        "size": 3,
    }
    assert "key" not in to_json(record, drop=frozenset({"key"}))
