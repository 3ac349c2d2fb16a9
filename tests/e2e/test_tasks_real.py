"""eval-tasks on the real SmolLM2 with lm-eval's own LAMBADA (offline data): broken scales are significantly worse,
calibrated ones indistinguishable from the unquantised cache."""

from __future__ import annotations

import pytest
from helpers import scaled_copy

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.evaluation.tasks import TaskOptions, evaluate_tasks

pytestmark = pytest.mark.slow
LIMIT = 40  # /64: 0.28 -> 0.00 on 100 items, interval [-0.37, -0.19]; calibrated identical on every item


def test_lambada_tells_broken_scales_from_calibrated_ones(
    smollm2, text_dataset, task_data, tmp_path
):
    calibrate(
        smollm2,
        str(text_dataset),
        tmp_path / "cal",
        CalibrateOptions(num_samples=16, max_seq_len=256, bf16_compute="float32"),
    )
    broken = scaled_copy(tmp_path / "cal", tmp_path / "scales-div64", 1 / 64)
    result = evaluate_tasks(
        str(tmp_path / "cal"),
        TaskOptions(
            tasks=("lambada_openai",),
            task_data=str(task_data),
            limit=LIMIT,
            compare=(str(broken),),
            bf16_compute="float32",
            batch_size=4,
        ),
    )
    [acc] = [row for row in result.rows if row.metric == "acc"]
    ours, theirs = acc.intervals["checkpoint"], acc.intervals[str(broken)]
    print(
        f"LAMBADA acc on {acc.items} items: baseline {acc.baseline:.3f}, calibrated {acc.scores['checkpoint']:.3f} "
        f"{ours}, /64 {acc.scores[str(broken)]:.3f} {theirs}"
    )
    assert acc.items == LIMIT
    assert (
        ours.outcome == "indistinguishable"
        and acc.verdict("checkpoint", cell=True) == "indistinguishable"
    )
    assert (
        theirs.outcome == "worse"
        and theirs.high < -0.1
        and acc.verdict(str(broken)).startswith("worse by")
    )
