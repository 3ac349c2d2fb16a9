"""serve-check's intervals on the probe text's ΔNLL (kvcalib.serving.predict.delta_intervals): served, predicted and
their difference, paired token by token and resampled in blocks of consecutive tokens."""

from __future__ import annotations

import pytest

from kvcalib.serving.predict import BLOCK_TOKENS, Prediction, delta_intervals


def prediction(token_delta: list[float]) -> Prediction:
    return Prediction(
        "vllm-cpu",
        2.0,
        2.0 + sum(token_delta) / len(token_delta),
        sum(token_delta) / len(token_delta),
        token_delta=tuple(token_delta),
    )


def test_served_predicted_and_their_difference():
    n = 10 * BLOCK_TOKENS
    baseline = [2.0 + 0.01 * (i % 7) for i in range(n)]
    served = [
        b + 0.05 + 0.02 * ((i % 5) - 2) for i, b in enumerate(baseline)
    ]  # +0.05 per token, with spread
    predicted = [
        0.04 + 0.02 * ((i % 5) - 2) for i in range(n)
    ]  # +0.04: the difference is exactly 0.01 a token
    warnings = []
    found = delta_intervals(baseline, served, prediction(predicted), warnings)
    assert warnings == []
    assert found.served.estimate == pytest.approx(
        0.05
    ) and found.predicted.estimate == pytest.approx(0.04)
    difference = found.served_minus_predicted
    assert difference.items == 10 and difference.low == pytest.approx(0.01) == difference.high
    assert found.served.low <= 0.05 <= found.served.high
    assert "blocks of 16 tokens" in found.served.method


def test_what_cannot_be_paired_says_why():
    warnings = []
    found = delta_intervals(
        None, [2.0] * 40, prediction([0.1] * 40), warnings
    )  # Neuron: no baseline server
    assert (
        found.served is None
        and found.served_minus_predicted is None
        and found.predicted is not None
    )
    assert warnings == []
    found = delta_intervals([2.0] * 40, [2.1] * 40, prediction([0.1] * 41), warnings)
    assert found.served is not None and found.served_minus_predicted is None
    assert warnings == [
        "the servers scored 40 tokens, the prediction 41: the two tokenised the text differently, so "
        "served and predicted are not paired"
    ]
    found = delta_intervals([2.0] * 40, [2.1] * 40, None, [])  # --no-predict
    assert found.predicted is None and found.served_minus_predicted is None
