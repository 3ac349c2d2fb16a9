"""The chip is data: a chip that exists only in this test (FP8 E5M2, max 57344, applied as GPU vLLM applies a
scale) goes through calibrate -> validate -> eval with no change to the package for it."""

from __future__ import annotations

import json

import pytest
import torch

from kvcalib import calibrate, evaluate, validate
from kvcalib.calibration.objective import candidates
from kvcalib.core import fp8
from kvcalib.core.schema import PROVENANCE_FILENAME

E5M2 = fp8.Target(
    "e5m2-test", "float8_e5m2", 57344.0, fp8.DIVIDE
)  # torch.finfo(torch.float8_e5m2).max
SMALL = {"num_samples": 16, "max_seq_len": 64}


@pytest.fixture
def e5m2(monkeypatch):
    monkeypatch.setitem(fp8.TARGETS, E5M2.name, E5M2)
    return E5M2


def test_a_chip_defined_here_calibrates_validates_and_evaluates(
    e5m2, tiny_llama, text_dataset, tmp_path
):
    absmax = calibrate(
        tiny_llama,
        str(text_dataset),
        tmp_path / "absmax",
        target=e5m2.name,
        scale_objective="absmax",
        **SMALL,
    )
    assert absmax.target == e5m2.name
    for layer in absmax.layers:
        for kind in "kv":
            peak, scale = getattr(layer, kind).absmax, getattr(layer, kind).scale
            assert scale == float(
                fp8.scale_from_absmax(peak, e5m2)
            )  # absmax / 57344, rounded for x / s
            assert scale == pytest.approx(peak / 57344, rel=1e-6)

    chosen = calibrate(
        tiny_llama, str(text_dataset), tmp_path / "attention", target=e5m2.name, **SMALL
    )
    provenance = json.loads((tmp_path / "attention" / PROVENANCE_FILENAME).read_text())
    assert provenance["target"] == e5m2.name and provenance["fp8_max"] == 57344
    assert provenance["scored_on"] == [e5m2.name]  # no other server holds a 57344 range
    labels = []
    for layer in chosen.layers:
        for kind in "kv":
            record = getattr(layer, kind)
            choice = record.choice
            labels.append(choice.label)
            # absmax is a candidate (the first): every choice is judged against its error
            assert choice.attention_error_absmax >= choice.attention_error >= 0.0
            assert dict(choice.attention_error_on) == {e5m2.name: choice.attention_error}
            if choice.label == "absmax":
                assert choice.attention_error == choice.attention_error_absmax
                assert record.scale == float(fp8.scale_from_absmax(record.absmax, e5m2))
    assert (
        "absmax" in labels
    )  # this model has no channel a clip would help (6 of 6 chose absmax here)

    for out in ("absmax", "attention"):
        report = validate(tmp_path / out, target=e5m2.name)
        assert report.ok, report.findings

    result = evaluate(
        tmp_path / "attention",
        str(text_dataset),
        target=e5m2.name,
        compare=("unit",),
        num_samples=4,
        max_seq_len=64,
    )
    checkpoint, unit = result.runs
    # E5M2 keeps 2 mantissa bits: ~25.5 dB SQNR here, where E4M3's 3 bits give ~31 (6 dB a bit)
    assert all(
        18.0 < sqnr < 28.0
        for layer in checkpoint.layers
        for sqnr in (layer.k.sqnr_db, layer.v.sqnr_db)
    )
    assert all(layer.k.clipped == 0.0 for layer in unit.layers)  # scale 1.0: nothing reaches 57344


def test_the_objectives_first_candidate_is_absmax(e5m2):
    grid = candidates(torch.tensor([3.0, 5.0]), e5m2, per_head=True)
    assert grid.labels[0] == "absmax" and not any(
        label.startswith("absmax/") for label in grid.labels
    )
    assert torch.equal(grid.scales[0], fp8.scale_from_absmax(torch.tensor([3.0, 5.0]), e5m2))


def test_its_quantiser_is_the_e5m2_cast(e5m2):
    """x / s clamped at 57344 and cast to float8_e5m2 (nearest even), as GPU vLLM applies a scale."""
    x = torch.tensor([1.1, 1.125, 1.375, -3.3, 60000.0, 2.0**-16, 2.0**-17])
    # E5M2: 2 mantissa bits, step 0.25 in [1, 2); 1.125 ties to 1.0 (even), 1.375 to 1.5; smallest subnormal 2^-16
    assert fp8.fake_quantize(x, 1.0, e5m2).tolist() == [1.0, 1.0, 1.5, -3.5, 57344.0, 2.0**-16, 0.0]
    assert fp8.fake_quantize(x * 2, 2.0, e5m2).tolist() == [
        2.0,
        2.0,
        3.0,
        -7.0,
        114688.0,
        2.0**-15,
        0.0,
    ]
