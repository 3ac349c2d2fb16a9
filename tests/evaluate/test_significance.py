"""The paired bootstrap on constructed cases, and eval's intervals on a real run."""

from __future__ import annotations

import random

import pytest

from kvcalib.core.records import to_json
from kvcalib.evaluation.pipeline import EvalOptions, evaluate
from kvcalib.evaluation.significance import paired_bootstrap


def test_identical_runs_give_an_interval_of_zero():
    interval = paired_bootstrap([0.0] * 50, [100] * 50)
    assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)
    assert not interval.significant
    assert (
        interval.outcome == "indistinguishable"
        and interval.verdict(cell=True) == "indistinguishable"
    )
    assert interval.verdict().startswith(
        "indistinguishable from the unquantised cache (+0.0000, 95% interval"
    )


def test_a_known_shift_is_recovered():
    rng = random.Random(1)
    tokens, differences = [], []
    for _ in range(
        100
    ):  # per-sequence sums: 0.1 nats a token, noise of 0.05 that cancels exactly in pairs
        n, noise = rng.randint(50, 300), rng.gauss(0, 0.05)
        tokens += [n, n]
        differences += [n * (0.1 + noise), n * (0.1 - noise)]
    interval = paired_bootstrap(differences, tokens)
    assert interval.estimate == pytest.approx(0.1)
    assert 0.09 < interval.low < 0.1 < interval.high < 0.11
    assert (
        interval.significant
        and interval.outcome == "worse"
        and interval.verdict().startswith("worse by 0.1")
    )
    assert (
        interval.verdict(cell=True) == f"worse by 0.1000 ± {(interval.high - interval.low) / 2:.4f}"
    )
    better = paired_bootstrap([-d for d in differences], tokens)
    assert to_json(better)["outcome"] == "better" and better.verdict().startswith("better by 0.1")
    accuracy = paired_bootstrap([-d for d in differences], tokens, worse_if_higher=False)
    assert accuracy.outcome == "worse" and accuracy.verdict("{:+.2%}").startswith("worse by 10.")


def test_noise_around_zero_is_indistinguishable_and_the_interval_is_deterministic():
    rng = random.Random(2)
    noise = [rng.gauss(0, 1) for _ in range(50)]
    differences = noise + [-x for x in noise]  # mean exactly 0
    first, again = paired_bootstrap(differences), paired_bootstrap(differences)
    assert first == again  # a fixed seed: the same inputs, the same interval
    assert first.low < 0 < first.high and not first.significant


def test_ratio_of_sums_weighs_sequences_by_their_tokens():
    interval = paired_bootstrap([0.2 * n for n in (10, 20, 300)], [10, 20, 300])
    assert interval.estimate == pytest.approx(0.2) and interval.low == pytest.approx(0.2)
    assert interval.high == pytest.approx(0.2)


def test_no_interval_rather_than_a_fake_one():
    assert paired_bootstrap([0.5], [10]) is None  # one item has no spread
    assert paired_bootstrap([], []) is None
    assert paired_bootstrap([0.1, float("nan")], [1, 1]) is None


def test_eval_reports_paired_intervals(calibrated, text_dataset):
    """The interval's estimate is the run's own ΔNLL (both are Σ / Σ tokens), in --json with its method."""
    result = evaluate(
        calibrated,
        str(text_dataset),
        EvalOptions(num_samples=8, max_seq_len=64, compare=("unit",), layer_rows=0),
    )
    for run in result.runs:
        nll, accuracy = run.delta_nll_interval, run.delta_accuracy_interval
        assert nll.items == accuracy.items == 8
        assert nll.estimate == pytest.approx(run.delta_nll, abs=1e-9)
        assert accuracy.estimate == pytest.approx(run.accuracy - result.baseline_accuracy, abs=1e-9)
        assert nll.low <= nll.estimate <= nll.high
        payload = to_json(run)
        assert payload["delta_nll_interval"]["method"].startswith("paired bootstrap over items")
        assert set(payload["delta_accuracy_interval"]) == {
            "estimate",
            "low",
            "high",
            "items",
            "level",
            "method",
            "significant",
            "outcome",
        }
        assert (
            not accuracy.worse_if_higher and nll.worse_if_higher
        )  # a lower accuracy is worse, a higher NLL
    single = evaluate(
        calibrated, str(text_dataset), EvalOptions(num_samples=1, max_seq_len=64, layer_rows=0)
    )
    assert single.runs[0].delta_nll_interval is None is single.runs[0].delta_accuracy_interval
